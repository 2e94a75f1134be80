//! libFuzzer entry for `tyche_fuzz::nbd::run_stream` (raw client byte streams, seeded with
//! qemu's and the kernel's).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tyche_fuzz_bins::once();
    tyche_fuzz::nbd::run_stream(data);
});
