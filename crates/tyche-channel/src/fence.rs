//! The storage side of a fence.
//!
//! When an initiator attaches again (a new session of the same initiator on the same export,
//! after its engine restarted and lost the old session's id), the admission fences the older
//! sessions ([`Joined::fenced`](crate::Joined)). The old session's writes may still sit in the
//! target's queues, or in storage that has stalled, while the initiator re-issues the same
//! requests in the new session and goes on writing. The target keeps two promises so that no
//! write of the old session lands after one of the new:
//!
//! - **A fenced session starts no storage operation from then on.** Each part of it closes its
//!   channels and answers ABORTED the requests it handed out that storage has not been given
//!   ([`TargetSession::fence`](crate::TargetSession::fence)); storage gives up any operation of
//!   it that it comes to start later ([`Fenceable::is_fenced`]).
//! - **The new session starts none before every operation of the sessions it fenced has
//!   ended** ([`FenceWait::holds`]): operations that storage had already started run to their
//!   end, and the new session's first operation waits for the last of them.
//!
//! What a session's threads share for this ([`Fenceable`]) belongs to the runtime: tyched keeps
//! it in atomics, one cache line per network thread; the simulator keeps it in cells, and drives
//! these same decisions over storage that sometimes stalls under the old session's writes.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::{Arc, Weak};

/// What a fence reads and writes of one target session's storage work: one per session,
/// shared by every part of it.
pub trait Fenceable {
    /// Fences the session: from now on none of its storage operations starts.
    fn fence(&self);
    /// Whether the session was fenced: a storage operation of it about to start is given up
    /// (answered ABORTED) instead.
    fn is_fenced(&self) -> bool;
    /// Whether any storage operation of the session is outstanding: counted from before
    /// storage may start it (before the fence's check) until after it ended or was given up.
    fn busy(&self) -> bool;
}

/// A shared session is its session.
macro_rules! through_pointer {
    ($($pointer:ident),*) => {$(
        impl<T: Fenceable + ?Sized> Fenceable for $pointer<T> {
            fn fence(&self) {
                (**self).fence();
            }
            fn is_fenced(&self) -> bool {
                (**self).is_fenced()
            }
            fn busy(&self) -> bool {
                (**self).busy()
            }
        }
    )*};
}
through_pointer!(Arc, Rc);

/// A session that is gone ran its last storage operation: it counts as fenced and idle.
impl<T: Fenceable> Fenceable for Weak<T> {
    fn fence(&self) {
        if let Some(s) = self.upgrade() {
            s.fence();
        }
    }
    fn is_fenced(&self) -> bool {
        self.upgrade().is_none_or(|s| s.is_fenced())
    }
    fn busy(&self) -> bool {
        self.upgrade().is_some_and(|s| s.busy())
    }
}

/// A session's storage work kept on one thread (the simulator's, and a runtime that serves a
/// session from one thread): the fence flag and the operations outstanding.
#[derive(Debug, Default)]
pub struct LocalWork {
    fenced: Cell<bool>,
    outstanding: Cell<u64>,
}

impl LocalWork {
    /// An operation of the session is counted: from before storage may start it.
    pub fn started(&self) {
        self.outstanding.set(self.outstanding.get() + 1);
    }

    /// An operation counted by [`LocalWork::started`] ended or was given up.
    ///
    /// # Panics
    /// If none was outstanding (a caller's bug).
    pub fn ended(&self) {
        let n = self.outstanding.get().checked_sub(1).expect("an operation ended that was never started");
        self.outstanding.set(n);
    }
}

impl Fenceable for LocalWork {
    fn fence(&self) {
        self.fenced.set(true);
    }
    fn is_fenced(&self) -> bool {
        self.fenced.get()
    }
    fn busy(&self) -> bool {
        self.outstanding.get() > 0
    }
}

/// What holds a new session's storage operations: the sessions it fenced, until every
/// operation of theirs has ended. Each thread holding a part of the new session keeps a copy
/// (the sessions are shared, so any copy sees the same work).
#[derive(Debug, Clone)]
pub struct FenceWait<W> {
    fenced: Vec<W>,
}

impl<W> Default for FenceWait<W> {
    /// Nothing to wait for (a session that fenced none).
    fn default() -> Self {
        FenceWait { fenced: Vec::new() }
    }
}

impl<W: Fenceable> FenceWait<W> {
    /// Fences `old` (the sessions [`Joined::fenced`](crate::Joined) names for a new session)
    /// and returns what holds the new session until their storage work has ended.
    pub fn fencing(old: impl IntoIterator<Item = W>) -> Self {
        let fenced: Vec<W> = old.into_iter().collect();
        for w in &fenced {
            w.fence();
        }
        FenceWait { fenced }
    }

    /// Whether a storage operation of the new session must wait now: a session it fenced still
    /// has one outstanding. Once none has, the wait is over for good (a fenced session starts
    /// nothing new), and later calls answer at once.
    pub fn holds(&mut self) -> bool {
        if self.fenced.is_empty() {
            return false;
        }
        if self.fenced.iter().any(Fenceable::busy) {
            return true;
        }
        self.fenced.clear();
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_session_waits_until_the_fenced_sessions_work_has_ended() {
        let (a, b) = (Rc::new(LocalWork::default()), Rc::new(LocalWork::default()));
        a.started();
        a.started();
        let mut wait = FenceWait::fencing([Rc::clone(&a), Rc::clone(&b)]);
        assert!(a.is_fenced() && b.is_fenced(), "fencing marks every old session");
        assert!(wait.holds());
        a.ended();
        assert!(wait.holds(), "one operation of the old session is still outstanding");
        a.ended();
        assert!(!wait.holds());
        a.started();
        assert!(!wait.holds(), "a fenced session starts nothing new: the wait stays over");
    }

    #[test]
    fn a_session_that_is_gone_is_fenced_and_idle() {
        let a = Arc::new(AtomicWork::default());
        a.outstanding.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut wait = FenceWait::fencing([Arc::downgrade(&a)]);
        assert!(a.is_fenced() && wait.holds());
        drop(a);
        assert!(!wait.holds());
        let gone: Weak<AtomicWork> = Weak::new();
        assert!(gone.is_fenced() && !gone.busy());
        assert!(!FenceWait::<Weak<AtomicWork>>::default().holds());
    }

    #[derive(Default)]
    struct AtomicWork {
        fenced: std::sync::atomic::AtomicBool,
        outstanding: std::sync::atomic::AtomicBool,
    }

    impl Fenceable for AtomicWork {
        fn fence(&self) {
            self.fenced.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        fn is_fenced(&self) -> bool {
            self.fenced.load(std::sync::atomic::Ordering::SeqCst)
        }
        fn busy(&self) -> bool {
            self.outstanding.load(std::sync::atomic::Ordering::SeqCst)
        }
    }
}
