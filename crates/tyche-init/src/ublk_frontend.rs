//! The ublk front end: `/dev/ublkbN` for a [`Client`] through libublk (`crate::ublk`), behind
//! [`BlockFrontend`]; without the `ublk` feature every call says the build has none.

use std::path::Path;

use crate::client::Client;
use crate::frontend::{BlockFrontend, FrontendError, UblkOptions, UBLK_CONTROL};

/// The ublk front end.
#[derive(Debug)]
pub struct UblkFrontend;

impl UblkFrontend {
    /// Checks that the kernel offers ublk.
    pub fn probe() -> Result<(), FrontendError> {
        if !Path::new(UBLK_CONTROL).exists() {
            return Err(FrontendError::NoUblk);
        }
        Ok(())
    }

    /// Creates `/dev/ublkbN` for `client`.
    pub fn create(client: Client, opts: UblkOptions) -> Result<Box<dyn BlockFrontend + Send>, FrontendError> {
        Self::probe()?;
        #[cfg(feature = "ublk")]
        {
            Ok(Box::new(crate::ublk::UblkDevice::new(client, opts)?))
        }
        #[cfg(not(feature = "ublk"))]
        {
            let _ = (client, opts);
            Err(FrontendError::NotBuilt)
        }
    }

    /// Takes over `/dev/ublkb{id}` (created with recovery by a process that died) for `client`.
    pub fn recover(client: Client, id: u32) -> Result<Box<dyn BlockFrontend + Send>, FrontendError> {
        Self::probe()?;
        #[cfg(feature = "ublk")]
        {
            Ok(Box::new(crate::ublk::UblkDevice::recover(client, id)?))
        }
        #[cfg(not(feature = "ublk"))]
        {
            let _ = (client, id);
            Err(FrontendError::NotBuilt)
        }
    }

    /// The process that serves `/dev/ublkb{id}` (the kernel's `ublksrv_pid`), if the device
    /// exists and has been started.
    pub fn server_pid(id: u32) -> Option<i32> {
        Self::probe().ok()?;
        #[cfg(feature = "ublk")]
        {
            crate::ublk::server_pid(id)
        }
        #[cfg(not(feature = "ublk"))]
        {
            let _ = id;
            None
        }
    }

    /// Deletes `/dev/ublkb{id}`, a device whose server is gone; I/O still waiting on it fails.
    pub fn delete(id: u32) -> Result<(), FrontendError> {
        Self::probe()?;
        #[cfg(feature = "ublk")]
        {
            crate::ublk::delete(id)
        }
        #[cfg(not(feature = "ublk"))]
        {
            let _ = id;
            Err(FrontendError::NotBuilt)
        }
    }
}
