//! A new configuration applied to a running target ([`TargetHandle::reload`]): what
//! [`crate::reload::plan`] says can change now is done here, everything or nothing.
//!
//! Exports a reload adds are opened first (outside the control's lock), then, under it, their
//! backends go into the storage threads' table, the acceptor offers them after the exports it
//! offered already (so no export's index changes), and the control takes the new export list,
//! with the new access rules of the exports that stay. A network thread takes that list with
//! the first channel of a new export it installs ([`super::control::Opening`]); channels open
//! before the reload run on as they were.

use std::sync::Arc;

use crate::config::{Config, ConfigError, MAX_EXPORTS};

use super::start::open_export;
use super::{control, Export, StartError, TargetHandle};

/// What a reload applied, and what it could not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reloaded {
    /// Exports added and served now.
    pub added: Vec<String>,
    /// Exports whose access rules (allow-list, key, `shared`) changed.
    pub updated: Vec<String>,
    /// What the configuration says and the target will not do until it restarts, each naming
    /// its field.
    pub needs_restart: Vec<String>,
}

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An export it adds could not be opened.
    #[error(transparent)]
    Open(#[from] StartError),
    /// More exports than a target serves (those removed from the file still count until the
    /// next start).
    #[error("{0} exports would be served; at most {MAX_EXPORTS} (exports removed from the file keep their place until a restart)")]
    TooMany(usize),
}

impl TargetHandle {
    /// Applies what can change of `new` while the target runs (see [`crate::reload`]) and
    /// reports it; on an error nothing changed. Either way the outcome is counted in the
    /// snapshot's `reload`.
    pub fn reload(&mut self, new: &Config) -> Result<Reloaded, ReloadError> {
        let r = self.try_reload(new);
        let mut ctl = control::lock(&self.shared.control);
        match &r {
            Ok(done) => {
                ctl.reload.applied += 1;
                ctl.reload.last_error = None;
                ctl.reload.needs_restart = done.needs_restart.clone();
            }
            Err(e) => self.count_failure(&mut ctl, e.to_string()),
        }
        r
    }

    /// Counts a reload refused before it reached the target (a configuration file that does
    /// not read), as [`TargetHandle::reload`] counts its own.
    pub fn reload_failed(&self, why: String) {
        self.count_failure(&mut control::lock(&self.shared.control), why);
    }

    fn count_failure(&self, ctl: &mut control::Control, why: String) {
        ctl.reload.failed += 1;
        ctl.reload.last_error = Some(why);
    }

    fn try_reload(&mut self, new: &Config) -> Result<Reloaded, ReloadError> {
        new.validate()?;
        let plan = crate::reload::plan(&self.config, new);
        let mut out = Reloaded { needs_restart: plan.needs_restart, ..Reloaded::default() };
        // Everything that can fail, first: the kept exports' keys, the new exports opened.
        let mut access = Vec::new();
        for &(i, j) in &plan.kept {
            let e = &new.exports[j];
            let key = e
                .key_bytes()
                .map_err(|message| ConfigError::Invalid { field: format!("export[{j}].key_file"), message })?;
            access.push((i, j, e.allowed_macs(), key));
        }
        // Which of the new exports this target can serve now, counted before any is opened (a
        // file export opened with a size is created).
        let mut to_open = Vec::new();
        for &j in &plan.added {
            let e = &new.exports[j];
            if e.path.is_some() && !self.storage_kinds.threads {
                out.needs_restart.push(format!(
                    "export {:?}: a file or block export on a target started with RAM exports only (it has no storage threads)",
                    e.name
                ));
                continue;
            }
            to_open.push(j);
        }
        let total = self.config.exports.len() + to_open.len();
        if total > MAX_EXPORTS {
            return Err(ReloadError::TooMany(total));
        }
        let mut opened = Vec::new();
        for j in to_open {
            opened.push((j, open_export(&new.exports[j], j, self.storage_kinds.node)?));
        }
        let mut ctl = control::lock(&self.shared.control);
        let mut list: Vec<Export> = ctl.exports.to_vec();
        for (i, j, allow, key) in access {
            let (e, c) = (&mut list[i], &new.exports[j]);
            // A key added or taken away needs a restart (the plan says so): the running one stays.
            let key = if key.is_some() == e.key.is_some() { key } else { e.key.clone() };
            if e.allow != allow || e.key.as_deref() != key.as_deref() || e.shared != c.shared {
                out.updated.push(e.spec.name.clone());
                (e.allow, e.key, e.shared) = (allow, key, c.shared);
                let running = &mut self.config.exports[i];
                running.allow.clone_from(&c.allow);
                if c.keyed() == running.keyed() {
                    running.key.clone_from(&c.key);
                    running.key_file.clone_from(&c.key_file);
                }
                running.shared = c.shared;
            }
        }
        for (j, mut e) in opened {
            let index = list.len();
            e.uring = self.storage_kinds.uring && e.backend.as_file().is_some();
            // Into the storage threads' table before any session can name it.
            assert!(self.storage_kinds.backends.set(index, Arc::clone(&e.backend)), "slot {index} is free and in room");
            let offered = ctl.admission.acceptor.add_export(e.spec.clone());
            assert_eq!(offered, Some(index), "the acceptor offers the control's exports, in order");
            tracing::info!(export = %e.spec.name, index, "export added by a reload");
            out.added.push(e.spec.name.clone());
            list.push(e);
            ctl.denied.push(0);
            self.config.exports.push(new.exports[j].clone());
        }
        ctl.exports = list.into();
        Ok(out)
    }
}
