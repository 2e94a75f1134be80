//! What Tyche's two daemons share around their frame loops, apart from the protocol and the
//! transports: [`poll::Poller`] decides, after each turn of a thread that serves transports,
//! whether it polls again or sleeps (adaptive polling); [`wake::WakeFd`] is the eventfd every
//! thread that sleeps in `poll(2)` (or in an io_uring) is woken through; [`stats_socket`] serves
//! a daemon's counters as one JSON document per connection on a Unix socket.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod poll;
pub mod stats_socket;
pub mod wake;
