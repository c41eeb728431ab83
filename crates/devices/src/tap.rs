//! A TAP network device of the host: the system calls the standard
//! library does not wrap. Every `unsafe` block of this crate lives here.
//!
//! The device is opened with a virtio-net header of 12 bytes in front of
//! every frame (`IFF_VNET_HDR`, `TUNSETVNETHDRSZ`), the layout a
//! virtio 1.0 driver uses, so frames pass between TAP and guest unchanged.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::time::Duration;

/// Bytes of the virtio-net header in front of each frame.
pub const VNET_HDR_LEN: usize = 12;
/// Longest interface name (IFNAMSIZ without the NUL).
pub const MAX_NAME_LEN: usize = 15;

/// Offloads the guest accepts (TUNSETOFFLOAD flags).
pub const OFFLOAD_CSUM: u32 = libc::TUN_F_CSUM;
pub const OFFLOAD_TSO4: u32 = libc::TUN_F_TSO4;

/// `struct ifreq`: a name and a 24-byte union (flags, or a sockaddr).
#[repr(C)]
#[derive(Default)]
struct IfReq {
    name: [u8; 16],
    data: [u8; 24],
}

impl IfReq {
    fn new(name: &str) -> Self {
        let mut req = IfReq::default();
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        req
    }

    fn set_ipv4(&mut self, addr: Ipv4Addr) {
        self.data = [0; 24];
        self.data[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        self.data[4..8].copy_from_slice(&addr.octets());
    }
}

/// Checks a TAP interface name the user gave.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(format!(
            "interface name {name:?} must be 1 to {MAX_NAME_LEN} bytes"
        ));
    }
    if name == "." || name == ".." || name.bytes().any(|b| b == b'/' || b <= b' ' || b == 0x7f) {
        return Err(format!(
            "interface name {name:?} contains characters Linux does not allow"
        ));
    }
    Ok(())
}

fn ioctl(fd: &impl AsRawFd, request: libc::Ioctl, arg: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: every caller passes a request whose argument is the pointer
    // `arg` to a live, correctly sized object (IfReq or c_int) or a plain
    // integer, as the request's ABI says; the fd is open.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request, arg) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// An open TAP device.
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Attaches to TAP interface `name`, creating it if it does not exist
    /// (it then lasts as long as this process holds it).
    pub fn open(name: &str) -> io::Result<Tap> {
        check_name(name).map_err(|m| io::Error::new(io::ErrorKind::InvalidInput, m))?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/net/tun")?;
        let mut req = IfReq::new(name);
        let flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
        req.data[..2].copy_from_slice(&flags.to_ne_bytes());
        ioctl(&file, libc::TUNSETIFF, (&mut req as *mut IfReq).cast())?;
        let mut hdr_len = VNET_HDR_LEN as libc::c_int;
        ioctl(
            &file,
            libc::TUNSETVNETHDRSZ,
            (&mut hdr_len as *mut libc::c_int).cast(),
        )?;
        let tap = Tap {
            file,
            name: name.to_owned(),
        };
        tap.set_offload(0)?;
        Ok(tap)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// Frames the host kernel dropped on their way to this device's
    /// reader (its queue was full): the interface's `tx_dropped` counter,
    /// from sysfs; `None` where sysfs does not show this network
    /// namespace's interfaces.
    pub fn host_dropped(&self) -> Option<u64> {
        let path = format!("/sys/class/net/{}/statistics/tx_dropped", self.name);
        let mut text = String::new();
        File::open(path)
            .ok()?
            .take(32)
            .read_to_string(&mut text)
            .ok()?;
        text.trim().parse().ok()
    }

    /// Tells the host which offloads the guest accepts: with TSO4 the host
    /// may hand over TCP segments of up to 64 KiB.
    pub fn set_offload(&self, flags: u32) -> io::Result<()> {
        // TUNSETOFFLOAD takes the flags as the argument itself.
        ioctl(&self.file, libc::TUNSETOFFLOAD, flags as usize as *mut _)
    }

    /// Gives the interface an IPv4 address with `prefix` bits of netmask,
    /// and brings it up (needs CAP_NET_ADMIN).
    pub fn configure(&self, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
        // SAFETY: plain socket(2) call; the result is checked and owned.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor nobody else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut req = IfReq::new(&self.name);
        req.set_ipv4(addr);
        ioctl(
            &sock,
            libc::SIOCSIFADDR as _,
            (&mut req as *mut IfReq).cast(),
        )?;
        let mask = u32::MAX
            .checked_shl(32 - u32::from(prefix.min(32)))
            .unwrap_or(0);
        req.set_ipv4(Ipv4Addr::from(mask));
        ioctl(
            &sock,
            libc::SIOCSIFNETMASK as _,
            (&mut req as *mut IfReq).cast(),
        )?;
        let mut req = IfReq::new(&self.name);
        ioctl(
            &sock,
            libc::SIOCGIFFLAGS as _,
            (&mut req as *mut IfReq).cast(),
        )?;
        let flags = i16::from_ne_bytes([req.data[0], req.data[1]]) | libc::IFF_UP as i16;
        req.data[..2].copy_from_slice(&flags.to_ne_bytes());
        ioctl(
            &sock,
            libc::SIOCSIFFLAGS as _,
            (&mut req as *mut IfReq).cast(),
        )
    }

    /// Waits up to `timeout` for a frame; errors when the device went away.
    pub fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        let mut pfd = libc::pollfd {
            fd: self.file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `pfd` is one live pollfd, matching the count of 1.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            };
        }
        if pfd.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the TAP device went away",
            ));
        }
        Ok(pfd.revents & libc::POLLIN != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_linux_rejects_are_rejected_here() {
        assert!(check_name("insight0").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name("a-name-that-is-too-long").is_err());
        assert!(check_name("a/b").is_err());
        assert!(check_name("a b").is_err());
        assert!(check_name("..").is_err());
    }
}
