//! libFuzzer entry for `tyche_fuzz::target`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tyche_fuzz_bins::once();
    tyche_fuzz::target::run(data);
});
