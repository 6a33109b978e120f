//! The schemas folder's undo journal: what a registration's renames replace, written before the first of
//! them, so that a process killed between two renames (a crash, an OOM kill, a power cut) leaves a change
//! that the next start-up, or another replica's folder watch, takes back rather than half of it.
//!
//! A registration writes every file under a temporary name first and then renames them into place one by
//! one. Each rename is atomic, the set is not. So before the first rename, the journal
//! ([`JOURNAL_FILE`], in the schemas folder) is written whole (under a temporary name, synced, renamed)
//! with what each schema file held before (or that it did not exist) and the temporary names; after the
//! last rename, it is removed. A journal found later means a registration that never finished: its
//! caller got no `200`, so putting every file back ([`roll_back`]) is the answer it was owed, "nothing
//! registered". Kept versions under `versions/` are not put back: an extra one is harmless.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The journal's name in the schemas folder: hidden, and not `*.yaml`, so it is never read as a schema.
pub const JOURNAL_FILE: &str = ".hydrant-journal";

/// What a registration's renames change, to put back.
#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Undo {
    /// Each schema file the registration replaces, creates or removes, and what it held before
    /// (`None`: it did not exist).
    pub restore: Vec<(PathBuf, Option<String>)>,
    /// The temporary files the registration wrote, to remove.
    pub temporaries: Vec<PathBuf>,
}

fn journal(dir: &Path) -> PathBuf {
    dir.join(JOURNAL_FILE)
}

/// Flushes a folder's entries (a rename, a removal) to disk.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir).and_then(|d| d.sync_all())
}

/// Writes the journal of `undo` in `dir`, whole and on disk, before the renames it covers.
pub fn begin(dir: &Path, undo: &Undo) -> std::io::Result<()> {
    let text = serde_json::to_vec(undo).map_err(std::io::Error::other)?;
    let tmp = dir.join(format!("{JOURNAL_FILE}.tmp"));
    std::fs::write(&tmp, text)?;
    std::fs::File::open(&tmp).and_then(|f| f.sync_all())?;
    std::fs::rename(&tmp, journal(dir))?;
    sync_dir(dir)
}

/// Removes the journal once every rename it covers is done (or undone).
pub fn end(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(journal(dir)) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether `dir` holds the journal of a registration that did not finish.
pub fn pending(dir: &Path) -> bool {
    journal(dir).exists()
}

/// Puts back what the journal in `dir` says an unfinished registration changed, and removes the journal:
/// the files put back, or `None` when there was no journal. The caller holds the folder's lock.
pub fn roll_back(dir: &Path) -> Result<Option<Vec<PathBuf>>, String> {
    let path = journal(dir);
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let undo: Undo = serde_json::from_slice(&text).map_err(|e| {
        format!(
            "{} is not a registration journal hydrant wrote ({e}); move it away once the schema files are as they should be",
            path.display()
        )
    })?;
    let failed = |p: &Path, e: std::io::Error| {
        format!(
            "cannot put back {} from the journal {}: {e}",
            p.display(),
            path.display()
        )
    };
    for (file, before) in &undo.restore {
        match before {
            Some(text) => {
                let tmp = file.with_file_name(format!(
                    ".{}.hydrant-undo",
                    file.file_name()
                        .map(|n| n.to_string_lossy())
                        .unwrap_or_default()
                ));
                std::fs::write(&tmp, text)
                    .and_then(|()| std::fs::File::open(&tmp).and_then(|f| f.sync_all()))
                    .and_then(|()| std::fs::rename(&tmp, file))
                    .map_err(|e| failed(file, e))?;
            }
            None => match std::fs::remove_file(file) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(failed(file, e)),
            },
        }
    }
    for tmp in &undo.temporaries {
        let _ = std::fs::remove_file(tmp);
    }
    let mut dirs: Vec<&Path> = undo
        .restore
        .iter()
        .filter_map(|(f, _)| f.parent())
        .collect();
    dirs.sort();
    dirs.dedup();
    for d in dirs {
        sync_dir(d).map_err(|e| failed(d, e))?;
    }
    end(dir).map_err(|e| failed(&path, e))?;
    Ok(Some(undo.restore.into_iter().map(|(f, _)| f).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_cut_between_its_renames_is_put_back_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b, c) = (
            dir.path().join("a.yaml"),
            dir.path().join("b.yaml"),
            dir.path().join("c.yaml"),
        );
        std::fs::write(&a, "old a").expect("a");
        std::fs::write(&b, "old b").expect("b");
        let tmp_b = dir.path().join(".b.yaml.hydrant-tmp");
        std::fs::write(&tmp_b, "new b").expect("tmp b");
        let undo = Undo {
            restore: vec![
                (c.clone(), None),
                (a.clone(), Some("old a".to_owned())),
                (b.clone(), Some("old b".to_owned())),
            ],
            temporaries: vec![tmp_b.clone()],
        };
        begin(dir.path(), &undo).expect("journal");
        assert!(pending(dir.path()));
        // The process dies after two of the three renames.
        std::fs::write(&c, "new c").expect("c");
        std::fs::write(&a, "new a").expect("a renamed");

        let restored = roll_back(dir.path()).expect("rolled back");
        assert_eq!(restored, Some(vec![c.clone(), a.clone(), b.clone()]));
        assert_eq!(std::fs::read_to_string(&a).expect("a"), "old a");
        assert_eq!(std::fs::read_to_string(&b).expect("b"), "old b");
        assert!(!c.exists(), "c.yaml was new");
        assert!(!tmp_b.exists());
        assert!(!pending(dir.path()));
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["a.yaml", "b.yaml"]);
        // Nothing left to do the second time.
        assert_eq!(roll_back(dir.path()).expect("no journal"), None);
    }

    #[test]
    fn a_journal_that_is_not_hydrants_is_refused_by_name_and_left_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(JOURNAL_FILE), "{not json").expect("journal");
        let e = roll_back(dir.path()).expect_err("unreadable");
        assert!(
            e.contains(JOURNAL_FILE) && e.contains("not a registration journal"),
            "{e}"
        );
        assert!(pending(dir.path()));
    }
}
