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
//! registered". Kept versions under `.versions/` are journaled too: a version kept by a registration
//! that is taken back would name a version that never ran.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The journal's name in the schemas folder: hidden, and not `*.yaml`, so it is never read as a schema.
pub const JOURNAL_FILE: &str = ".hydrant-journal";

/// One schema file a registration replaces, creates or removes.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Change {
    /// Its path inside the schemas folder, so the journal holds wherever the folder is mounted.
    pub file: PathBuf,
    /// What it held before (`None`: it did not exist).
    pub before: Option<String>,
    /// What the registration puts there (`None`: it removes the file).
    pub after: Option<String>,
}

/// What a registration's renames change, to put back.
#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Undo {
    pub changes: Vec<Change>,
    /// The temporary files the registration wrote, inside the folder, to remove.
    pub temporaries: Vec<PathBuf>,
}

impl Undo {
    /// `path` inside `dir`, as the journal records it.
    pub fn inside(dir: &Path, path: &Path) -> PathBuf {
        path.strip_prefix(dir).unwrap_or(path).to_owned()
    }
}

fn journal(dir: &Path) -> PathBuf {
    dir.join(JOURNAL_FILE)
}

fn staged_journal(dir: &Path) -> PathBuf {
    dir.join(format!("{JOURNAL_FILE}.tmp"))
}

/// Flushes a folder's entries (a rename, a removal) to disk, where the file system can: some cannot
/// sync a folder, and the rename itself is done either way.
pub(crate) fn sync_dir(dir: &Path) {
    let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
}

/// Writes `text` to `path` whole: under a temporary name beside it, synced, renamed into place.
pub(crate) fn replace(path: &Path, text: &str, temporary: &Path) -> std::io::Result<()> {
    std::fs::write(temporary, text)?;
    std::fs::File::open(temporary).and_then(|f| f.sync_all())?;
    std::fs::rename(temporary, path)
}

/// Writes the journal of `undo` in `dir`, whole and on disk, before the renames it covers.
pub fn begin(dir: &Path, undo: &Undo) -> std::io::Result<()> {
    let text = serde_json::to_string(undo).map_err(std::io::Error::other)?;
    replace(&journal(dir), &text, &staged_journal(dir))?;
    sync_dir(dir);
    Ok(())
}

/// Removes the journal once every rename it covers is done (or undone).
pub fn end(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(journal(dir)) {
        Ok(()) => {
            sync_dir(dir);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether `dir` holds the journal of a registration that did not finish.
pub fn pending(dir: &Path) -> bool {
    journal(dir).exists()
}

/// A path the journal names, inside `dir`: a journal naming anything outside is not hydrant's.
fn within(dir: &Path, file: &Path) -> Option<PathBuf> {
    let plain = file.components().all(|c| matches!(c, Component::Normal(_)));
    (plain && file.components().next().is_some()).then(|| dir.join(file))
}

/// Puts back what the journal in `dir` says an unfinished registration changed, and removes the journal:
/// the files put back, or `None` when there was no journal. The caller holds the folder's lock.
///
/// Every file must hold what it held before the registration or what the registration wrote; a file
/// changed since by anything else (a deploy, a checkout) stops the whole roll-back before it changes
/// anything, since putting back only some files could leave a mix of both that compiles.
pub fn roll_back(dir: &Path) -> Result<Option<Vec<PathBuf>>, String> {
    let path = journal(dir);
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // A journal cut while it was written: nothing was renamed after it.
            let _ = std::fs::remove_file(staged_journal(dir));
            return Ok(None);
        }
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let move_away = "move it away once the schema files are as they should be";
    let undo: Undo = serde_json::from_slice(&text).map_err(|e| {
        format!(
            "{} is not a registration journal hydrant wrote ({e}); {move_away}",
            path.display()
        )
    })?;
    let mut files = Vec::with_capacity(undo.changes.len());
    for c in &undo.changes {
        let file = within(dir, &c.file).ok_or_else(|| {
            format!(
                "{} names {}, outside the schemas folder; {move_away}",
                path.display(),
                c.file.display()
            )
        })?;
        let now = match std::fs::read_to_string(&file) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("cannot read {}: {e}", file.display())),
        };
        if now != c.before && now != c.after {
            return Err(format!(
                "{} records a registration that did not finish, but {} changed since: it holds neither what it held before the registration nor what the registration wrote, so nothing was put back; {move_away}",
                path.display(),
                file.display()
            ));
        }
        files.push((file, now));
    }
    let failed = |p: &Path, e: std::io::Error| {
        format!(
            "cannot put back {} from the journal {}: {e}",
            p.display(),
            path.display()
        )
    };
    for (c, (file, now)) in undo.changes.iter().zip(&files) {
        if *now == c.before {
            continue;
        }
        match &c.before {
            Some(text) => {
                let name = file
                    .file_name()
                    .map(|n| n.to_string_lossy())
                    .unwrap_or_default();
                let tmp = file.with_file_name(format!(".{name}.hydrant-undo"));
                replace(file, text, &tmp).map_err(|e| failed(file, e))?;
            }
            None => match std::fs::remove_file(file) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(failed(file, e)),
            },
        }
    }
    for tmp in undo.temporaries.iter().filter_map(|t| within(dir, t)) {
        let _ = std::fs::remove_file(tmp);
    }
    let mut dirs: Vec<&Path> = files.iter().filter_map(|(f, _)| f.parent()).collect();
    dirs.sort();
    dirs.dedup();
    for d in dirs {
        sync_dir(d);
    }
    end(dir).map_err(|e| failed(&path, e))?;
    Ok(Some(files.into_iter().map(|(f, _)| f).collect()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The names of the entries of `dir`, sorted.
    pub(crate) fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// A folder holding `a.yaml` ("old a") and `b.yaml` ("old b"), and the paths of those two and of a
    /// `c.yaml` not there yet.
    pub(crate) fn folder_of_a_and_b() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let [a, b, c] = ["a.yaml", "b.yaml", "c.yaml"].map(|f| dir.path().join(f));
        std::fs::write(&a, "old a").expect("a");
        std::fs::write(&b, "old b").expect("b");
        (dir, a, b, c)
    }

    #[test]
    fn a_registration_cut_between_its_renames_is_put_back_whole() {
        let (dir, a, b, c) = folder_of_a_and_b();
        let tmp_b = dir.path().join(".b.yaml.hydrant-tmp");
        std::fs::write(&tmp_b, "new b").expect("tmp b");
        let change = |file: &str, before: Option<&str>, after: Option<&str>| Change {
            file: file.into(),
            before: before.map(str::to_owned),
            after: after.map(str::to_owned),
        };
        let undo = Undo {
            changes: vec![
                change("c.yaml", None, Some("new c")),
                change("a.yaml", Some("old a"), Some("new a")),
                change("b.yaml", Some("old b"), Some("new b")),
            ],
            temporaries: vec![".b.yaml.hydrant-tmp".into()],
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
        assert_eq!(names_in(dir.path()), ["a.yaml", "b.yaml"]);
        // Nothing left to do the second time.
        assert_eq!(roll_back(dir.path()).expect("no journal"), None);
    }

    #[test]
    fn a_file_changed_since_the_cut_stops_the_roll_back_before_anything_is_put_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
        std::fs::write(&a, "new a").expect("a");
        std::fs::write(&b, "deployed b").expect("b");
        let undo = Undo {
            changes: vec![
                Change {
                    file: "a.yaml".into(),
                    before: Some("old a".into()),
                    after: Some("new a".into()),
                },
                Change {
                    file: "b.yaml".into(),
                    before: Some("old b".into()),
                    after: Some("new b".into()),
                },
            ],
            temporaries: Vec::new(),
        };
        begin(dir.path(), &undo).expect("journal");
        let e = roll_back(dir.path()).expect_err("b changed since");
        assert!(e.contains("b.yaml") && e.contains("changed since"), "{e}");
        assert_eq!(
            std::fs::read_to_string(&a).expect("a"),
            "new a",
            "untouched"
        );
        assert!(pending(dir.path()));
    }

    #[test]
    fn a_journal_naming_a_file_outside_the_folder_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        for file in ["../x.yaml", "/etc/passwd", ""] {
            let undo = Undo {
                changes: vec![Change {
                    file: file.into(),
                    before: None,
                    after: Some("x".into()),
                }],
                temporaries: Vec::new(),
            };
            begin(dir.path(), &undo).expect("journal");
            let e = roll_back(dir.path()).expect_err("outside");
            assert!(e.contains("outside the schemas folder"), "{file:?}: {e}");
        }
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
