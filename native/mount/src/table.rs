//! The inode table of one snapshot, built once from the manifest's columns (no I/O).
//!
//! Numbering is the Python mount's (`spokefs.mount.inodes`): directory `k` of the sorted
//! directory list is inode `1 + k` (the root "" sorts first: inode 1, FUSE's root), file `i`
//! of the manifest's columns is inode `1 + dirs + i`. Directories are the manifest's own
//! (empty ones included) and every parent of a path. Each directory keeps its children
//! sorted by name, folders first, then files, so a lookup is two binary searches and a
//! listing resumes exactly at a position (readdir offsets are positions, stable because the
//! table never changes).

use std::collections::{HashMap, HashSet};
use std::fmt;

/// FUSE's root inode.
pub const ROOT: u64 = 1;

/// What is wrong with the columns handed in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableError(pub String);

impl fmt::Display for TableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TableError {}

/// The manifest's columns, as the mount is given them.
#[derive(Debug, Clone, Default)]
pub struct Columns {
    pub paths: Vec<String>,
    pub sizes: Vec<u64>,
    pub modes: Vec<u32>,
    pub mtimes_ns: Vec<i64>,
    pub versions: Vec<String>,
    /// Every directory of the manifest ("" the root); parents of paths are added anyway,
    /// so this may be empty (then empty directories are not shown).
    pub dirs: Vec<String>,
}

/// What stat shows for an inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub is_dir: bool,
    /// Permission bits only (never setuid, setgid or sticky); directories are 0o555.
    pub perm: u16,
    pub size: u64,
    pub mtime_ns: i64,
}

/// One snapshot's files and directories as inodes.
#[derive(Debug)]
pub struct InodeTable {
    dirs: Vec<String>,
    dir_parent: Vec<u32>,
    /// Per directory: children inodes (folders first, each part sorted by name) and how
    /// many of them are folders.
    children: Vec<(Vec<u64>, usize)>,
    paths: Vec<String>,
    sizes: Vec<u64>,
    modes: Vec<u32>,
    mtimes_ns: Vec<i64>,
    /// Per file: its version's number in `versions` (equal versions share one).
    vids: Vec<u32>,
    versions: Vec<String>,
    vid_of: HashMap<String, u32>,
    created_ns: i64,
    total_bytes: u64,
}

fn parent_of(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(head, _)| head)
}

fn name_of(path: &str) -> &str {
    path.rsplit_once('/').map_or(path, |(_, tail)| tail)
}

fn bad_path(p: &str) -> bool {
    p.is_empty()
        || p.starts_with('/')
        || p.ends_with('/')
        || p.split('/').any(|s| s.is_empty() || s == "." || s == "..")
}

impl InodeTable {
    /// Build the table; `created_ns` is what directories show as their times.
    pub fn new(cols: Columns, created_ns: i64) -> Result<InodeTable, TableError> {
        let n = cols.paths.len();
        for (what, len) in [
            ("sizes", cols.sizes.len()),
            ("modes", cols.modes.len()),
            ("mtimes_ns", cols.mtimes_ns.len()),
            ("versions", cols.versions.len()),
        ] {
            if len != n {
                return Err(TableError(format!("{n} paths but {len} {what}")));
            }
        }
        if n > (u32::MAX as usize) / 2 {
            return Err(TableError(format!("{n} files: more than a mount holds")));
        }
        // Every directory with all its parents; a chain stops at the first one known (its
        // parents were added with it).
        let mut dir_set: HashSet<String> = HashSet::with_capacity(cols.dirs.len() + 1);
        dir_set.insert(String::new());
        fn add_chain(set: &mut HashSet<String>, mut dir: &str) {
            while !dir.is_empty() && !set.contains(dir) {
                set.insert(dir.to_owned());
                dir = parent_of(dir);
            }
        }
        for d in &cols.dirs {
            if !d.is_empty() {
                if bad_path(d) {
                    return Err(TableError(format!("bad directory name {d:?}")));
                }
                add_chain(&mut dir_set, d);
            }
        }
        for p in &cols.paths {
            if bad_path(p) {
                return Err(TableError(format!("bad file path {p:?}")));
            }
            add_chain(&mut dir_set, parent_of(p));
        }
        let mut dir_set: Vec<String> = dir_set.into_iter().collect();
        dir_set.sort_unstable();
        let dirs = dir_set;
        let ndirs = dirs.len();
        let dir_index: HashMap<&str, u32> =
            dirs.iter().enumerate().map(|(k, d)| (d.as_str(), k as u32)).collect();

        let mut dir_parent = vec![0u32; ndirs];
        let mut kids_dirs: Vec<Vec<u64>> = vec![Vec::new(); ndirs];
        for (k, d) in dirs.iter().enumerate().skip(1) {
            let p = dir_index[parent_of(d)];
            dir_parent[k] = p;
            kids_dirs[p as usize].push(1 + k as u64);
        }
        let mut kids_files: Vec<Vec<u64>> = vec![Vec::new(); ndirs];
        for (i, p) in cols.paths.iter().enumerate() {
            if dir_index.contains_key(p.as_str()) {
                return Err(TableError(format!("{p:?} is both a file and a directory")));
            }
            let parent = dir_index[parent_of(p)];
            kids_files[parent as usize].push(1 + ndirs as u64 + i as u64);
        }
        drop(dir_index);

        let mut vid_of: HashMap<String, u32> = HashMap::new();
        let mut versions: Vec<String> = Vec::new();
        let mut vids = Vec::with_capacity(n);
        for v in cols.versions {
            let next = versions.len() as u32;
            let id = *vid_of.entry(v.clone()).or_insert_with(|| {
                versions.push(v);
                next
            });
            vids.push(id);
        }

        let total_bytes = cols.sizes.iter().sum();
        let mut table = InodeTable {
            dirs,
            dir_parent,
            children: Vec::with_capacity(ndirs),
            paths: cols.paths,
            sizes: cols.sizes,
            modes: cols.modes,
            mtimes_ns: cols.mtimes_ns,
            vids,
            versions,
            vid_of,
            created_ns,
            total_bytes,
        };
        let mut children = Vec::with_capacity(ndirs);
        for (mut ds, mut fs) in kids_dirs.into_iter().zip(kids_files) {
            ds.sort_unstable_by(|a, b| table.name(*a).cmp(table.name(*b)));
            fs.sort_unstable_by(|a, b| table.name(*a).cmp(table.name(*b)));
            for w in fs.windows(2) {
                if table.name(w[0]) == table.name(w[1]) {
                    return Err(TableError(format!("{:?} is listed twice", table.path(w[0]))));
                }
            }
            let nd = ds.len();
            ds.extend(fs);
            children.push((ds, nd));
        }
        table.children = children;
        Ok(table)
    }

    // -- numbering ----------------------------------------------------------------------
    pub fn dir_count(&self) -> usize {
        self.dirs.len()
    }

    pub fn file_count(&self) -> usize {
        self.paths.len()
    }

    pub fn inode_count(&self) -> u64 {
        (self.dirs.len() + self.paths.len()) as u64
    }

    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    pub fn is_dir(&self, ino: u64) -> bool {
        ino >= 1 && ino <= self.dirs.len() as u64
    }

    /// The file index of inode `ino`, if it is a file.
    pub fn file_index(&self, ino: u64) -> Option<usize> {
        let first = 1 + self.dirs.len() as u64;
        (ino >= first && ino < first + self.paths.len() as u64).then(|| (ino - first) as usize)
    }

    pub fn file_inode(&self, index: usize) -> u64 {
        1 + self.dirs.len() as u64 + index as u64
    }

    /// The path of an inode ("" for the root), if it exists.
    pub fn path(&self, ino: u64) -> Option<&str> {
        if self.is_dir(ino) {
            return Some(&self.dirs[(ino - 1) as usize]);
        }
        self.file_index(ino).map(|i| self.paths[i].as_str())
    }

    /// The last component of an inode's path ("" for the root or an unknown inode).
    pub fn name(&self, ino: u64) -> &str {
        self.path(ino).map_or("", name_of)
    }

    /// A file's size, version number and version id.
    pub fn file(&self, index: usize) -> (u64, u32, &str) {
        let vid = self.vids[index];
        (self.sizes[index], vid, &self.versions[vid as usize])
    }

    /// The version id of version number `vid`.
    pub fn version(&self, vid: u32) -> &str {
        &self.versions[vid as usize]
    }

    /// The number of a version id of this snapshot (None: no file here has it).
    pub fn vid(&self, version: &str) -> Option<u32> {
        self.vid_of.get(version).copied()
    }

    // -- attributes ---------------------------------------------------------------------
    pub fn attr(&self, ino: u64) -> Option<Attr> {
        if self.is_dir(ino) {
            return Some(Attr {
                ino,
                is_dir: true,
                perm: 0o555,
                size: 0,
                mtime_ns: self.created_ns,
            });
        }
        let i = self.file_index(ino)?;
        Some(Attr {
            ino,
            is_dir: false,
            perm: (self.modes[i] & 0o777) as u16,
            size: self.sizes[i],
            mtime_ns: self.mtimes_ns[i],
        })
    }

    // -- lookup and listing -------------------------------------------------------------
    /// The parent directory of an inode (the root's is the root).
    pub fn parent(&self, ino: u64) -> u64 {
        if self.is_dir(ino) {
            return 1 + self.dir_parent[(ino - 1) as usize] as u64;
        }
        match self.path(ino) {
            Some(p) => self.lookup_dir(parent_of(p)).unwrap_or(ROOT),
            None => ROOT,
        }
    }

    fn lookup_dir(&self, path: &str) -> Option<u64> {
        self.dirs.binary_search_by(|d| d.as_str().cmp(path)).ok().map(|k| 1 + k as u64)
    }

    /// The inode named `name` inside directory `parent`.
    pub fn lookup(&self, parent: u64, name: &str) -> Option<u64> {
        if !self.is_dir(parent) || name.is_empty() || name.contains('/') {
            return None;
        }
        match name {
            "." => return Some(parent),
            ".." => return Some(self.parent(parent)),
            _ => {}
        }
        let (kids, nd) = &self.children[(parent - 1) as usize];
        let (ds, fs) = kids.split_at(*nd);
        for part in [ds, fs] {
            if let Ok(at) = part.binary_search_by(|k| self.name(*k).cmp(name)) {
                return Some(part[at]);
            }
        }
        None
    }

    /// The inode of a path ("" = the root), or None.
    pub fn lookup_path(&self, path: &str) -> Option<u64> {
        let mut ino = ROOT;
        if path.is_empty() {
            return Some(ino);
        }
        for part in path.split('/') {
            ino = self.lookup(ino, part)?;
        }
        Some(ino)
    }

    /// The children of a directory (folders first, then files), or None if not one.
    pub fn children(&self, ino: u64) -> Option<&[u64]> {
        self.is_dir(ino).then(|| self.children[(ino - 1) as usize].0.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(paths: &[&str], dirs: &[&str]) -> InodeTable {
        let n = paths.len();
        InodeTable::new(
            Columns {
                paths: paths.iter().map(|s| s.to_string()).collect(),
                sizes: (0..n as u64).map(|i| 100 + i).collect(),
                modes: vec![0o104755; n],
                mtimes_ns: (0..n as i64).map(|i| 1_000_000_000 * i).collect(),
                versions: (0..n).map(|i| format!("{:032x}", i % 3)).collect(),
                dirs: dirs.iter().map(|s| s.to_string()).collect(),
            },
            7,
        )
        .unwrap()
    }

    #[test]
    fn numbering_follows_the_python_mount() {
        let t = table(&["a/x", "a/y", "b/c/z", "top"], &["", "a", "b", "b/c", "empty"]);
        // dirs sorted: "", a, b, b/c, empty -> inodes 1..=5; files 6..=9 in manifest order.
        assert_eq!(t.dir_count(), 5);
        assert_eq!(t.path(1), Some(""));
        assert_eq!(t.path(4), Some("b/c"));
        assert_eq!(t.file_index(6), Some(0));
        assert_eq!(t.file_inode(3), 9);
        assert_eq!(t.path(9), Some("top"));
        assert_eq!(t.path(10), None);
        assert_eq!(t.path(0), None);
        assert_eq!(t.inode_count(), 9);
        assert_eq!(t.total_bytes(), 100 + 101 + 102 + 103);
    }

    #[test]
    fn directories_come_from_paths_and_the_manifest() {
        // No dirs column: parents are made from the paths; "empty" is then unknown.
        let t = table(&["a/b/c/d.txt", "e.txt"], &[]);
        assert_eq!(t.lookup_path("a/b/c"), Some(4));
        assert!(t.is_dir(t.lookup_path("a/b").unwrap()));
        let t = table(&["a/x"], &["empty", "deep/er"]);
        assert!(t.is_dir(t.lookup_path("empty").unwrap()));
        assert!(t.is_dir(t.lookup_path("deep").unwrap()));
        assert_eq!(t.children(t.lookup_path("empty").unwrap()), Some(&[][..]));
    }

    #[test]
    fn lookups_by_parent_and_name() {
        let t = table(&["a/x", "a/y", "b/c/z", "top"], &["empty"]);
        let a = t.lookup(ROOT, "a").unwrap();
        assert!(t.is_dir(a));
        let x = t.lookup(a, "x").unwrap();
        assert_eq!(t.path(x), Some("a/x"));
        assert_eq!(t.lookup(a, "nope"), None);
        assert_eq!(t.lookup(a, ""), None);
        assert_eq!(t.lookup(a, "x/y"), None);
        assert_eq!(t.lookup(x, "anything"), None); // a file is no parent
        assert_eq!(t.lookup(a, "."), Some(a));
        assert_eq!(t.lookup(a, ".."), Some(ROOT));
        assert_eq!(t.lookup(ROOT, ".."), Some(ROOT));
        assert_eq!(t.parent(x), a);
        assert_eq!(t.lookup_path("b/c/z").map(|i| t.name(i)), Some("z"));
        assert_eq!(t.lookup_path("b/c/z/w"), None);
        assert_eq!(t.lookup(999, "a"), None);
    }

    #[test]
    fn listings_are_folders_first_sorted_and_positional() {
        let t = table(&["d/b2", "d/a1", "d/zz/f", "d/mm/g", "d/c3"], &[]);
        let d = t.lookup_path("d").unwrap();
        let names: Vec<&str> = t.children(d).unwrap().iter().map(|k| t.name(*k)).collect();
        assert_eq!(names, ["mm", "zz", "a1", "b2", "c3"]);
        // Every child found by name, whatever its position.
        for k in t.children(d).unwrap() {
            assert_eq!(t.lookup(d, t.name(*k)), Some(*k));
        }
        assert_eq!(t.children(t.lookup_path("d/a1").unwrap()), None);
        let root: Vec<&str> = t.children(ROOT).unwrap().iter().map(|k| t.name(*k)).collect();
        assert_eq!(root, ["d"]);
    }

    #[test]
    fn attributes_keep_permission_bits_only() {
        let t = table(&["f"], &[]);
        let f = t.lookup_path("f").unwrap();
        let a = t.attr(f).unwrap();
        assert_eq!((a.is_dir, a.perm, a.size, a.mtime_ns), (false, 0o755, 100, 0));
        let r = t.attr(ROOT).unwrap();
        assert_eq!((r.is_dir, r.perm, r.mtime_ns), (true, 0o555, 7));
        assert_eq!(t.attr(f + 1), None);
    }

    #[test]
    fn equal_versions_share_a_number() {
        let t = table(&["a", "b", "c", "d"], &[]);
        let vids: Vec<u32> = (0..4).map(|i| t.file(i).1).collect();
        assert_eq!(vids, [0, 1, 2, 0]);
        assert_eq!(t.version(0), format!("{:032x}", 0));
        assert_eq!(t.vid(&format!("{:032x}", 2)), Some(2));
        assert_eq!(t.vid("nope"), None);
    }

    #[test]
    fn bad_columns_are_refused() {
        let mut c = Columns {
            paths: vec!["a".into()],
            sizes: vec![1],
            modes: vec![0o644],
            mtimes_ns: vec![0],
            versions: vec![],
            dirs: vec![],
        };
        assert!(InodeTable::new(c.clone(), 0).unwrap_err().0.contains("versions"));
        c.versions = vec!["v".into()];
        for bad in ["", "/a", "a/", "a//b", "a/../b", "./a"] {
            c.paths = vec![bad.into()];
            assert!(InodeTable::new(c.clone(), 0).is_err(), "{bad:?}");
        }
        c.paths = vec!["a".into()];
        c.dirs = vec!["a".into()];
        assert!(InodeTable::new(c.clone(), 0).unwrap_err().0.contains("both"));
        c.dirs = vec![];
        c.paths = vec!["a".into(), "a".into()];
        c.sizes = vec![1, 1];
        c.modes = vec![0, 0];
        c.mtimes_ns = vec![0, 0];
        c.versions = vec!["v".into(), "v".into()];
        assert!(InodeTable::new(c, 0).unwrap_err().0.contains("twice"));
    }

    #[test]
    fn a_big_table_builds_fast_enough() {
        let n = 200_000;
        let paths: Vec<String> = (0..n).map(|i| format!("c{:03}/f{:07}", i % 1000, i)).collect();
        let mut sorted = paths.clone();
        sorted.sort();
        let t = InodeTable::new(
            Columns {
                paths: sorted,
                sizes: vec![1; n],
                modes: vec![0o644; n],
                mtimes_ns: vec![0; n],
                versions: (0..n).map(|i| format!("{i:032x}")).collect(),
                dirs: vec![],
            },
            0,
        )
        .unwrap();
        assert_eq!(t.dir_count(), 1001);
        let ino = t.lookup_path("c007/f0012007").unwrap();
        assert_eq!(t.name(ino), "f0012007");
    }
}
