//! CubeCL's on-disk cache of compiled kernels, one directory per build of the running program.
//!
//! CubeCL 0.10 keys that cache by kernel name and compile-time arguments, not by the kernel's
//! code: a program rebuilt with a changed kernel (a new version, a local edit) would be served the
//! old kernel from a cache the previous build filled, without an error, and compute something else.
//! [`cache_per_build`] moves the cache of the running program into a directory named by its
//! executable's size and modification time, so that every build compiles its own kernels once and
//! never reads another's.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// The folder, under the configured cache root, that holds one directory per build.
pub const BUILDS_DIR: &str = "burnmix-kernels";

/// The file in a build's directory whose modification time says when that build last started.
const LAST_USED: &str = "last-used";

/// How long a build's directory is kept after that build last started.
const KEEP_UNUSED: Duration = Duration::from_secs(14 * 24 * 3600);

/// Points CubeCL's compiled-kernel cache at `<root>/burnmix-kernels/<this executable's identity>`
/// (its size and modification time: a build writes a new executable),
/// `<root>` being where CubeCL's configuration (`cubecl.toml`, `burn.toml`, the environment) puts
/// it, and removes the directories of builds that have not started for 14 days. Call it first in
/// `main`, before any CubeCL work: the configuration is fixed at CubeCL's first use.
///
/// Returns the directory, or `None` where nothing changed: no kernel cache is configured (CubeCL's
/// default), CubeCL's configuration is already fixed, or the executable cannot be read.
pub fn cache_per_build() -> Option<PathBuf> {
    if CubeClRuntimeConfig::storage().lock().is_some() {
        return None;
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    let root = config.compilation.cache.as_ref()?.root();
    let builds = root.join(BUILDS_DIR);
    let dir = builds.join(executable_identity()?);
    config.compilation.cache = Some(CacheConfig::File(dir.clone()));
    CubeClRuntimeConfig::set(config);
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join(LAST_USED), b"");
        prune(&builds, &dir);
    }
    Some(dir)
}

/// `<size>-<modification time in ns since 1970>` of the running executable: two builds that
/// differ in any byte are two files written at different times. (Hashing the bytes instead costs
/// seconds for an unoptimised build at every start, and the device probes start the executable
/// again.)
fn executable_identity() -> Option<String> {
    let meta = std::fs::metadata(std::env::current_exe().ok()?).ok()?;
    let modified = meta
        .modified()
        .ok()?
        .duration_since(SystemTime::UNIX_EPOCH)
        .ok()?;
    Some(format!("{}-{}", meta.len(), modified.as_nanos()))
}

/// Removes the build directories under `builds`, other than `current`, whose build last started
/// more than [`KEEP_UNUSED`] ago (a directory without the stamp counts from its own time).
fn prune(builds: &Path, current: &Path) {
    let Ok(entries) = std::fs::read_dir(builds) else {
        return;
    };
    let now = SystemTime::now();
    for entry in entries.flatten() {
        let path = entry.path();
        if path == current || !path.is_dir() {
            continue;
        }
        let used = std::fs::metadata(path.join(LAST_USED))
            .or_else(|_| std::fs::metadata(&path))
            .and_then(|m| m.modified());
        let stale = used.is_ok_and(|t| now.duration_since(t).unwrap_or_default() > KEEP_UNUSED);
        if stale {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A build directory whose stamp is older than the keeping time goes; a recent one, one
    /// without a stamp made just now, and the current build's stay.
    #[test]
    fn prune_removes_only_builds_unused_for_longer_than_kept() {
        let builds = std::env::temp_dir().join(format!("burnmix-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&builds);
        let dir = |name: &str, stamp_age: Option<Duration>| {
            let d = builds.join(name);
            std::fs::create_dir_all(&d).unwrap();
            if let Some(age) = stamp_age {
                let stamp = d.join(LAST_USED);
                std::fs::write(&stamp, b"").unwrap();
                let file = std::fs::File::options().write(true).open(&stamp).unwrap();
                file.set_modified(SystemTime::now() - age).unwrap();
            }
            d
        };
        let day = Duration::from_secs(24 * 3600);
        let old = dir("old", Some(15 * day));
        let recent = dir("recent", Some(13 * day));
        let unstamped = dir("unstamped", None);
        let current = dir("current", Some(30 * day));
        prune(&builds, &current);
        assert!(
            !old.exists(),
            "a build unused for 15 days should be removed"
        );
        assert!(recent.exists(), "a build used 13 days ago should stay");
        assert!(unstamped.exists(), "a directory made just now should stay");
        assert!(
            current.exists(),
            "the running build's directory should stay"
        );
        std::fs::remove_dir_all(&builds).unwrap();
    }
}
