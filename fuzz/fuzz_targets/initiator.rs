//! libFuzzer entry for `tyche_fuzz::initiator`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tyche_fuzz_bins::once();
    tyche_fuzz::initiator::run(data);
});
