//! The server against a small tree: what is seen, what is refused,
//! reads by digest, and garbage answered.
use super::*;

fn tree(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("insight-9p-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("shown/sub")).unwrap();
    std::fs::create_dir_all(dir.join("hidden")).unwrap();
    std::fs::write(dir.join("shown/data"), b"hello, guest").unwrap();
    std::fs::write(dir.join("hidden/secret"), b"no").unwrap();
    std::os::unix::fs::symlink("../hidden/secret", dir.join("shown/link")).unwrap();
    dir
}

fn request(kind: u8, fill: impl FnOnce(&mut Writer)) -> Vec<u8> {
    let mut w = Writer::new(kind, 1);
    fill(&mut w);
    w.finish()
}

fn ask(s: &mut HostFiles, kind: u8, fill: impl FnOnce(&mut Writer)) -> Vec<u8> {
    s.answer(&request(kind, fill), MAX_MSIZE).bytes()
}

fn errno_of(reply: &[u8]) -> Option<u32> {
    (reply[4] == p9::RLERROR).then(|| u32::from_le_bytes(reply[7..11].try_into().unwrap()))
}

/// Walks from fid 0 (the root) to `path`'s components as `newfid`.
fn walk(s: &mut HostFiles, newfid: u32, path: &Path) -> Vec<u8> {
    let names: Vec<_> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.as_bytes().to_vec()),
            _ => None,
        })
        .collect();
    ask(s, p9::TWALK, |w| {
        w.u32(0).u32(newfid).u16(names.len() as u16);
        for n in &names {
            w.string(n);
        }
    })
}

fn attached(exports: &[PathBuf]) -> HostFiles {
    let mut s = HostFiles::new(exports);
    let v = ask(&mut s, p9::TVERSION, |w| {
        w.u32(65536).string(b"9P2000.L");
    });
    assert_eq!(v[4], p9::RVERSION);
    let a = ask(&mut s, p9::TATTACH, |w| {
        w.u32(0).u32(!0).string(b"root").string(b"").u32(0);
    });
    assert_eq!(a[4], p9::RATTACH);
    s
}

#[test]
fn files_are_read_whole_and_served_by_digest() {
    let dir = tree("read");
    let mut s = attached(&[dir.join("shown")]);
    assert_eq!(walk(&mut s, 1, &dir.join("shown/data"))[4], p9::RWALK);
    assert_eq!(
        ask(&mut s, p9::TLOPEN, |w| {
            w.u32(1).u32(0);
        })[4],
        p9::RLOPEN
    );
    let answer = s.answer(
        &request(p9::TREAD, |w| {
            w.u32(1).u64(7).u32(100);
        }),
        MAX_MSIZE,
    );
    let Answer::Read {
        content,
        offset,
        count,
        ..
    } = &answer
    else {
        panic!("not a read: {answer:?}");
    };
    assert_eq!((*offset, *count), (7, 5));
    assert_eq!(
        content.digest,
        <[u8; 32]>::from(Sha256::digest(b"hello, guest"))
    );
    assert_eq!(&answer.bytes()[11..], b"guest");
    // Room for 3 bytes of data only: the read is cut to fit.
    let small = s.answer(
        &request(p9::TREAD, |w| {
            w.u32(1).u64(0).u32(100);
        }),
        14,
    );
    assert_eq!(&small.bytes()[11..], b"hel");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn only_the_exports_are_seen_and_nothing_is_written() {
    let dir = tree("exports");
    let mut s = attached(&[dir.join("shown")]);
    // The hidden tree is not found, nor reached by `..`.
    // (Its ancestors are walked, then the walk stops: fid 1 is not made.)
    let hidden = walk(&mut s, 1, &dir.join("hidden"));
    let steps = dir.join("hidden").components().count() as u16 - 1;
    assert_eq!(hidden[4], p9::RWALK);
    assert_eq!(u16::from_le_bytes([hidden[7], hidden[8]]), steps - 1);
    assert_eq!(
        errno_of(&ask(&mut s, p9::TGETATTR, |w| {
            w.u32(1).u64(0x7ff);
        })),
        Some(EBADF as u32)
    );
    let direct = HostFiles::new(&[dir.join("shown")]).visibility(&dir.join("hidden"));
    assert_eq!(direct, Visibility::Hidden);
    assert_eq!(walk(&mut s, 2, &dir.join("shown"))[4], p9::RWALK);
    let up = ask(&mut s, p9::TWALK, |w| {
        w.u32(2).u32(3).u16(2).string(b"..").string(b"hidden");
    });
    // The first step succeeds, the second is not found: a partial walk.
    assert_eq!(u16::from_le_bytes([up[7], up[8]]), 1);
    let slash = ask(&mut s, p9::TWALK, |w| {
        w.u32(2).u32(4).u16(1).string(b"../hidden");
    });
    assert_eq!(errno_of(&slash), Some(EINVAL as u32));
    // The root lists only the way to the export (a clone of the root
    // opened: an open fid walks no further).
    ask(&mut s, p9::TWALK, |w| {
        w.u32(0).u32(7).u16(0);
    });
    assert_eq!(
        ask(&mut s, p9::TLOPEN, |w| {
            w.u32(7).u32(0);
        })[4],
        p9::RLOPEN
    );
    let list = ask(&mut s, p9::TREADDIR, |w| {
        w.u32(7).u64(0).u32(8192);
    });
    let first = dir
        .components()
        .nth(1)
        .unwrap()
        .as_os_str()
        .as_bytes()
        .to_vec();
    let text = String::from_utf8_lossy(&list);
    assert!(text.contains(std::str::from_utf8(&first).unwrap()));
    // A link is read, not followed.
    walk(&mut s, 5, &dir.join("shown/link"));
    let link = ask(&mut s, p9::TREADLINK, |w| {
        w.u32(5);
    });
    assert!(String::from_utf8_lossy(&link).contains("../hidden/secret"));
    // Opening for writing, creating, removing: refused.
    walk(&mut s, 6, &dir.join("shown/data"));
    let open = ask(&mut s, p9::TLOPEN, |w| {
        w.u32(6).u32(2);
    });
    assert_eq!(errno_of(&open), Some(EROFS as u32));
    let mkdir = ask(&mut s, p9::TMKDIR, |w| {
        w.u32(2).string(b"new").u32(0o755).u32(0);
    });
    assert_eq!(errno_of(&mkdir), Some(EROFS as u32));
    assert!(!dir.join("shown/new").exists());
    // Garbage is answered, never fatal.
    assert_eq!(
        errno_of(&ask(&mut s, p9::TGETATTR, |_| {})),
        Some(EPROTO as u32)
    );
    assert_eq!(
        errno_of(&ask(&mut s, p9::TREAD, |w| {
            w.u32(99).u64(0).u32(1);
        })),
        Some(EBADF as u32)
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn random_requests_are_answered_never_fatal() {
    let dir = tree("random");
    let mut s = attached(&[dir.join("shown")]);
    walk(&mut s, 1, &dir.join("shown"));
    // A simple generator: the same requests in every run.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let kinds = [
        p9::TVERSION,
        p9::TATTACH,
        p9::TWALK,
        p9::TGETATTR,
        p9::TLOPEN,
        p9::TREAD,
        p9::TREADDIR,
        p9::TREADLINK,
        p9::TCLUNK,
        p9::TSTATFS,
        p9::TXATTRWALK,
        p9::TWRITE,
        0,
        255,
    ];
    for _ in 0..20_000 {
        let kind = kinds[(next() % kinds.len() as u64) as usize];
        let len = (next() % 40) as usize;
        let mut w = Writer::new(kind, next() as u16);
        for _ in 0..len {
            // Small fids and lengths, so that some requests make sense.
            w.u8((next() % 4) as u8);
        }
        let mut msg = w.finish();
        if next() % 8 == 0 {
            msg.truncate((next() % 8) as usize);
        }
        let room = (next() % 200) as u32;
        let reply = s.answer(&msg, room).bytes();
        assert!(reply.len() >= p9::HEADER_BYTES, "{reply:?}");
        let size = u32::from_le_bytes(reply[..4].try_into().unwrap()) as usize;
        assert_eq!(size, reply.len());
    }
    std::fs::remove_dir_all(dir).unwrap();
}
