//! Wrapping 32-bit ring positions (sequence numbers) and the bitmaps that track them.

/// `a - b` as a signed distance on the wrapping sequence space.
#[inline]
pub(crate) fn diff(a: u32, b: u32) -> i32 {
    a.wrapping_sub(b) as i32
}

/// A fixed-size bitmap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bitmap {
    words: Box<[u64]>,
}

impl Bitmap {
    pub(crate) fn new(bits: usize) -> Self {
        Bitmap { words: vec![0; bits.div_ceil(64)].into_boxed_slice() }
    }
    #[inline]
    pub(crate) fn get(&self, i: usize) -> bool {
        self.words[i / 64] & (1 << (i % 64)) != 0
    }
    #[inline]
    pub(crate) fn set(&mut self, i: usize) {
        self.words[i / 64] |= 1 << (i % 64);
    }
    #[inline]
    pub(crate) fn clear(&mut self, i: usize) {
        self.words[i / 64] &= !(1 << (i % 64));
    }
    pub(crate) fn clear_all(&mut self) {
        self.words.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapping_distance() {
        assert_eq!(diff(5, 3), 2);
        assert_eq!(diff(3, 5), -2);
        assert_eq!(diff(1, u32::MAX), 2);
        assert_eq!(diff(u32::MAX, 1), -2);
    }

    #[test]
    fn bitmap_bits() {
        let mut b = Bitmap::new(130);
        b.set(0);
        b.set(129);
        assert!(b.get(0) && b.get(129) && !b.get(64));
        b.clear(0);
        assert!(!b.get(0));
        b.clear_all();
        assert!(!b.get(129));
    }
}
