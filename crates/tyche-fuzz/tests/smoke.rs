fn smoke(name: &str, f: fn(&[u8])) {
    let mut x = 1u64;
    let t = std::time::Instant::now();
    let mut n = 0;
    while t.elapsed().as_secs() < 4 {
        let data: Vec<u8> = (0..600).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 }).collect();
        f(&data);
        n += 1;
    }
    eprintln!("{name}: {n} inputs, {}", tyche_fuzz::stats_line());
}
#[test]
fn target() { smoke("target", tyche_fuzz::target::run) }
#[test]
fn initiator() { smoke("initiator", tyche_fuzz::initiator::run) }
