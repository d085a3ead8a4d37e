//! Mounting as root the way libfuse does: open /dev/fuse, then mount(2) with type
//! `fuse.<subtype>` and the descriptor in the options, so /proc/self/mountinfo shows
//! `fuse.spokefs` as it does for the Python mount (fuser's own mount always says `fuse`).
//! The session then runs on the descriptor (`fuser::Session::from_fd`), and nothing here
//! unmounts behind the owner's back: unmounting is `Mount::unmount`'s lazy detach only.
//! Without the privilege (EPERM) the caller mounts through fuser, which runs fusermount3
//! (and that names the subtype itself).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// What to mount: libfuse-style options already split into kernel flags and data.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SysMount {
    pub fsname: String,
    pub subtype: String,
    pub flags: libc::c_ulong,
    /// Kernel options besides fd, rootmode, user_id and group_id (default_permissions,
    /// allow_other).
    pub data: Vec<String>,
}

impl SysMount {
    /// From the option names the Python mount uses (unknown ones are an error).
    pub fn from_options(options: &[String]) -> Result<SysMount, String> {
        let mut m = SysMount {
            fsname: "spokefs".into(),
            subtype: String::new(),
            flags: 0,
            data: Vec::new(),
        };
        for o in options {
            match o.as_str() {
                "ro" => m.flags |= libc::MS_RDONLY,
                "nosuid" => m.flags |= libc::MS_NOSUID,
                "nodev" => m.flags |= libc::MS_NODEV,
                "noexec" => m.flags |= libc::MS_NOEXEC,
                "noatime" => m.flags |= libc::MS_NOATIME,
                "default_permissions" | "allow_other" => m.data.push(o.clone()),
                "allow_root" => m.data.push("allow_other".into()), // fuser filters to root
                x if x.starts_with("fsname=") => m.fsname = x["fsname=".len()..].into(),
                x if x.starts_with("subtype=") => m.subtype = x["subtype=".len()..].into(),
                x => return Err(format!("mount option {x:?} is not one the native mount knows")),
            }
        }
        Ok(m)
    }

    pub fn fstype(&self) -> String {
        if self.subtype.is_empty() { "fuse".into() } else { format!("fuse.{}", self.subtype) }
    }

    /// The data string for a session on descriptor `fd`.
    pub fn data_for(&self, fd: i32, rootmode: u32, uid: u32, gid: u32) -> String {
        let mut d = format!("fd={fd},rootmode={rootmode:o},user_id={uid},group_id={gid}");
        for o in &self.data {
            d.push(',');
            d.push_str(o);
        }
        d
    }

    /// Open /dev/fuse and mount it at `mountpoint`; the session's descriptor. EPERM when
    /// this process may not mount (then use fusermount3).
    pub fn mount(&self, mountpoint: &Path, uid: u32, gid: u32) -> io::Result<OwnedFd> {
        let rootmode = std::fs::metadata(mountpoint)?.mode() & libc::S_IFMT;
        let dev = File::options().read(true).write(true).open("/dev/fuse")?;
        let data = self.data_for(dev.as_raw_fd(), rootmode, uid, gid);
        let c = |s: &[u8]| CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL));
        let (src, target, fstype, data) = (
            c(self.fsname.as_bytes())?,
            c(mountpoint.as_os_str().as_bytes())?,
            c(self.fstype().as_bytes())?,
            c(data.as_bytes())?,
        );
        // SAFETY: mount(2) only reads its arguments: four NUL-terminated strings that live
        // (owned CStrings) until the call returns, and an integer of flags. It writes no
        // memory of ours; the descriptor named in `data` is `dev`, open for the whole call.
        #[allow(unsafe_code)]
        let r = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                self.flags,
                data.as_ptr().cast(),
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(OwnedFd::from(dev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_become_flags_and_data() {
        let opts: Vec<String> = [
            "ro",
            "nosuid",
            "nodev",
            "default_permissions",
            "allow_other",
            "fsname=spokefs",
            "subtype=spokefs",
        ]
        .map(String::from)
        .to_vec();
        let m = SysMount::from_options(&opts).unwrap();
        assert_eq!(m.flags, libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV);
        assert_eq!(m.fstype(), "fuse.spokefs");
        assert_eq!(m.fsname, "spokefs");
        assert_eq!(
            m.data_for(7, 0o40000, 1000, 100),
            "fd=7,rootmode=40000,user_id=1000,group_id=100,default_permissions,allow_other"
        );
        assert!(SysMount::from_options(&["rw".into()]).is_err());
        assert_eq!(SysMount::from_options(&[]).unwrap().fstype(), "fuse");
    }
}
