//! The election lock file's identity, as the kernel's lock records name a
//! file: its device's major and minor and its inode.
//!
//! Why here: three readers match a lock record against the pair's lock
//! file. The shim reads `/proc/locks` (which engine serves) and an
//! engine's `/proc/<pid>/fdinfo` (whether the one that says `READY=1`
//! holds it); gmsd reads its own `fdinfo` (whether the descriptor shown
//! for the KV pool's write lease holds it). Each once kept its own copy of
//! the type and of the `st_dev` decoding; one of them decoding a device
//! number differently would fail a promotion or grant a lease wrongly.

use std::os::unix::fs::MetadataExt;

/// A file as `/proc/locks` and `fdinfo` print it: `major:minor:inode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileId {
    pub major: u32,
    pub minor: u32,
    pub inode: u64,
}

impl FileId {
    /// From `st_dev`/`st_ino` of a `stat` of the file.
    pub fn from_stat(dev: u64, ino: u64) -> FileId {
        // glibc's gnu_dev_major/minor encoding of a dev_t.
        let major = (((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0000_0fff)) as u32;
        let minor = (((dev >> 12) & 0xffff_ff00) | (dev & 0x0000_00ff)) as u32;
        FileId {
            major,
            minor,
            inode: ino,
        }
    }

    /// The file at `path`, as its `stat` says (symlinks followed).
    pub fn of_path(path: &std::path::Path) -> std::io::Result<FileId> {
        let md = std::fs::metadata(path)?;
        Ok(FileId::from_stat(md.dev(), md.ino()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// glibc's makedev, written out as its header defines it.
    fn makedev(major: u64, minor: u64) -> u64 {
        ((major & 0xffff_f000) << 32)
            | ((major & 0xfff) << 8)
            | ((minor & 0xffff_ff00) << 12)
            | (minor & 0xff)
    }

    #[test]
    fn device_numbers_decode_as_glibc_does() {
        for (major, minor) in [(8, 1), (0, 26), (259, 65536), (4095, 255), (4096, 256)] {
            let id = FileId::from_stat(makedev(major, minor), 9);
            assert_eq!(
                (id.major, id.minor, id.inode),
                (major as u32, minor as u32, 9)
            );
        }
    }

    #[test]
    fn a_path_is_its_stat() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("lock");
        std::fs::write(&path, b"").expect("create");
        let md = std::fs::metadata(&path).expect("stat");
        let id = FileId::of_path(&path).expect("of_path");
        assert_eq!(id, FileId::from_stat(md.dev(), md.ino()));
        assert!(FileId::of_path(&dir.path().join("absent")).is_err());
    }
}
