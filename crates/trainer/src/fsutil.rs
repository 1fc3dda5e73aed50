//! Files that are replaced whole: readers, and a run that crashes or is killed, see the old content
//! or the new one, never a mix.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The hidden temporary file beside `path` that [`replace_with`] writes first
/// (`dir/.name.tmp`).
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp"))
}

/// Replaces `path` with what `write` puts into the temporary path it is given: that file is synced
/// to disk, renamed over `path`, and the directory synced, so the new content survives a crash
/// once this returns.
pub fn replace_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temp_path(path);
    write(&tmp)?;
    File::open(&tmp)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot sync {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// Replaces `path` with `bytes` (see [`replace_with`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    replace_with(path, |tmp| {
        let mut f =
            File::create(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(bytes)
            .with_context(|| format!("cannot write {}", tmp.display()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_files_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("burnmix-fsutil-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.json");
        write_atomic(&p, b"old").unwrap();
        write_atomic(&p, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert!(!temp_path(&p).exists());
        let failed = replace_with(&p, |_| anyhow::bail!("no"));
        assert!(failed.is_err());
        assert_eq!(
            std::fs::read(&p).unwrap(),
            b"new",
            "a failed write leaves the old content"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
