//! A local stats socket, shared by `tyched` and `tyche-init`: a Unix socket that answers each
//! connection with one JSON document (a fresh snapshot) and closes it.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// A running stats server; stops (and removes its socket) on drop.
#[derive(Debug)]
pub struct StatsServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    path: PathBuf,
}

impl StatsServer {
    /// Listens on `path` (replacing a stale socket) and answers each connection with
    /// `source()` as JSON, from a thread named `thread`.
    pub fn start<T: Serialize>(
        path: &Path,
        thread: &str,
        source: impl Fn() -> T + Send + 'static,
    ) -> std::io::Result<StatsServer> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        if path.exists() {
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name(thread.into()).spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                        let json = serde_json::to_vec(&source()).expect("snapshot serialises");
                        let _ = s.write_all(&json);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Err(e) => {
                        let _ = e;
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        })?;
        Ok(StatsServer { stop, thread: Some(thread), path: path.to_owned() })
    }
}

impl Drop for StatsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Reads one document from the stats socket at `path`.
pub fn query<T: DeserializeOwned>(path: &Path) -> std::io::Result<T> {
    let mut s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    serde_json::from_slice(&buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}
