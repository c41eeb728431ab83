//! Network record and replay, end to end: traffic from the test's own
//! network namespace (a TAP device insight creates there, addresses
//! 10.0.2.2 host side and 10.0.2.15 in the guest) to receivers in the
//! guest, recorded once and replayed twice with no network at all.
//!
//! Every packet stays inside the namespace. The tests need /dev/kvm, the
//! guest image, and root (network namespaces, TAP devices).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

const GUEST: &str = "10.0.2.15";

/// A network namespace of the test's own, deleted when dropped.
struct Netns {
    name: String,
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("the ip command (iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Netns {
    fn new(tag: &str) -> Netns {
        let name = format!("insight-t{}-{tag}", std::process::id());
        ip(&["netns", "add", &name]);
        let ns = Netns { name };
        ip(&["netns", "exec", &ns.name, "ip", "link", "set", "lo", "up"]);
        // The host's default congestion control may be BBR, which paces
        // the sender to the slow ACKs of a guest whose kernel is
        // interpreted; the namespace's own setting keeps bulk tests short.
        ip(&[
            "netns",
            "exec",
            &ns.name,
            "sysctl",
            "-q",
            "-w",
            "net.ipv4.tcp_congestion_control=reno",
        ]);
        ns
    }

    /// `program` run inside the namespace.
    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    fn bash(&self, script: &str) -> Output {
        self.command("bash").args(["-c", script]).output().unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Fails unless the guest can boot and network namespaces and TAP devices
/// can be made (root).
fn network_ready() {
    guest_ready();
    assert!(
        is_root(),
        "this test makes network namespaces and TAP devices, which needs root"
    );
}

/// A config with a TAP device insight creates and configures.
fn config(dir: &Path, command: &str) -> PathBuf {
    let path = dir.join("vm.toml");
    std::fs::write(
        &path,
        format!(
            "command = {command:?}\n[net]\ntap = \"insight0\"\n\
             guest_address = \"{GUEST}/24\"\nhost_address = \"10.0.2.2/24\"\n"
        ),
    )
    .unwrap();
    path
}

/// A recording running in a namespace, its output read as it comes.
struct Recording {
    child: Child,
    lines: mpsc::Receiver<String>,
    stdout: String,
    stderr: std::thread::JoinHandle<String>,
}

impl Recording {
    fn start(ns: &Netns, config: &Path, trace: &Path) -> Recording {
        let mut child = ns
            .command(env!("CARGO_BIN_EXE_insight"))
            .args(["record", "--no-stdin", "-o"])
            .arg(trace)
            .arg(config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
            s
        });
        Recording {
            child,
            lines,
            stdout: String::new(),
            stderr,
        }
    }

    /// Waits for a console line containing `text`.
    fn wait_for(&mut self, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(180);
        while Instant::now() < deadline {
            match self.lines.recv_timeout(Duration::from_secs(1)) {
                Ok(line) => {
                    self.stdout.push_str(&line);
                    self.stdout.push('\n');
                    if line.contains(text) {
                        return;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let _ = self.child.kill();
        panic!(
            "the guest never printed {text:?}; it printed:\n{}",
            self.stdout
        );
    }

    /// Waits for the recording to end; returns exit status, stdout, stderr.
    fn finish(mut self) -> (Option<i32>, String, String) {
        let deadline = Instant::now() + Duration::from_secs(900);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the recording did not end; output:\n{}", self.stdout);
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.stdout.push_str(&line);
            self.stdout.push('\n');
        }
        (status.code(), self.stdout, self.stderr.join().unwrap())
    }
}

/// Replays `trace` (outside any namespace: no TAP device exists) and checks
/// every replay printed exactly what the recording printed, with no
/// network trouble.
fn assert_replays_without_a_network(trace: &Path, recorded: &str) {
    for stderr in assert_replays_identically(trace, recorded) {
        assert!(!stderr.contains("network:"), "{stderr}");
    }
}

/// The datagrams `udp_sink ... && cat FILE` printed after its summary
/// line, in the order the guest received them.
fn received_datagrams(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with("udp_sink: ") || !l.contains(" datagrams, sha256 "))
        .skip(1)
        .map(str::trim_end)
        .filter(|l| {
            *l == "end"
                || l.split_once(' ')
                    .is_some_and(|(s, i)| (s == "a" || s == "b") && i.parse::<u32>().is_ok())
        })
        .map(str::to_owned)
        .collect()
}

/// The payloads of the UDP datagrams to `port` in a pcap capture of
/// Ethernet frames, in capture order.
fn udp_payloads(pcap: &[u8], port: u16) -> Vec<Vec<u8>> {
    let u16_be = |b: &[u8], at: usize| u16::from_be_bytes([b[at], b[at + 1]]);
    let mut payloads = Vec::new();
    let mut at = 24;
    while at < pcap.len() {
        let len = u32::from_le_bytes(pcap[at + 8..at + 12].try_into().unwrap()) as usize;
        let frame = &pcap[at + 16..at + 16 + len];
        at += 16 + len;
        // IPv4 (ethertype 0x0800) carrying UDP (protocol 17).
        if frame.len() < 34 || u16_be(frame, 12) != 0x0800 || frame[23] != 17 {
            continue;
        }
        let ip = &frame[14..];
        let udp = &ip[usize::from(ip[0] & 0xf) * 4..usize::from(u16_be(ip, 2))];
        if u16_be(udp, 2) == port {
            payloads.push(udp[8..usize::from(u16_be(udp, 4))].to_vec());
        }
    }
    payloads
}

#[ignore = "needs root, /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn interleaved_udp_senders_replay_without_a_network() {
    const PER_SENDER: usize = 60;
    network_ready();
    let dir = scratch("udp");
    let trace = dir.join("trace");
    let ns = Netns::new("udp");
    // The guest prints what it received, in the order it received it.
    let config = config(&dir, "udp_sink 5000 2 /tmp/in && cat /tmp/in");
    let mut rec = Recording::start(&ns, &config, &trace);
    rec.wait_for("udp_sink: listening");
    // Two senders at once, 60 datagrams each, one every 20 ms, and an
    // "end": both are sending while the other is, about 100 datagrams a
    // second in all, which UDP does not retransmit and which the
    // interpreted guest kernel can take (about 10 ms each; above that a
    // plain run loses some too, docs/BENCHMARKS.md "Network"). Recordings
    // whose receive path kept the reading program from the CPU, or whose
    // guest's socket held only ~45 datagrams, lost some where a plain run
    // lost none.
    let senders = ns.bash(&format!(
        "for s in a b; do (for i in $(seq 1 {PER_SENDER}); do \
         echo \"$s $i\" > /dev/udp/{GUEST}/5000; sleep 0.02; done; \
         echo end > /dev/udp/{GUEST}/5000) & done; wait"
    ));
    assert!(senders.status.success(), "{senders:?}");
    let (status, stdout, stderr) = rec.finish();
    assert_eq!(status, Some(0), "{stdout}\n{stderr}");
    let all = 2 * PER_SENDER + 2;
    assert!(
        stdout.contains(&format!("udp_sink: {all} datagrams, sha256 ")),
        "{stdout}"
    );
    assert!(!stderr.contains("network:"), "{stderr}");
    let received = received_datagrams(&stdout);
    assert_eq!(received.len(), all, "{stdout}");
    // Each sender's datagrams all came, in the order it sent them.
    for s in ["a", "b"] {
        let numbers: Vec<String> = received
            .iter()
            .filter_map(|d| d.strip_prefix(&format!("{s} ")))
            .map(str::to_owned)
            .collect();
        let sent: Vec<String> = (1..=PER_SENDER).map(|i| i.to_string()).collect();
        assert_eq!(numbers, sent, "sender {s}: {received:?}");
    }
    // They interleaved: before either sender's "end", the guest received
    // from one, then the other, then the first again.
    let first_end = received.iter().position(|d| d == "end").unwrap();
    let switches = received[..first_end]
        .windows(2)
        .filter(|w| w[0][..1] != w[1][..1])
        .count();
    assert!(
        switches >= 2,
        "the senders did not interleave before the first end: {received:?}"
    );
    // Replay needs no namespace, no TAP device, no network.
    drop(ns);
    assert_replays_without_a_network(&trace, &stdout);

    // The frames can be inspected: a pcap of what the guest received.
    let pcap = dir.join("rx.pcap");
    let out = insight()
        .arg("dump")
        .arg(&trace)
        .arg("--rx-pcap")
        .arg(&pcap)
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let bytes = std::fs::read(&pcap).unwrap();
    assert_eq!(&bytes[..4], &[0xd4, 0xc3, 0xb2, 0xa1]);
    let datagrams = bytes.windows(4).filter(|w| w == b"end\n").count();
    assert_eq!(datagrams, 2, "the capture holds both senders' ends");
    // The frames the trace delivered carry, in order, what the guest
    // received.
    let delivered: Vec<u8> = udp_payloads(&bytes, 5000).concat();
    let printed: String = received.iter().map(|d| format!("{d}\n")).collect();
    assert_eq!(String::from_utf8_lossy(&delivered), printed);
    let dump = insight().arg("dump").arg(&trace).output().unwrap();
    assert!(text(&dump).0.contains("frames received"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs root, /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn tcp_bulk_transfer_replays() {
    network_ready();
    let dir = scratch("tcp");
    let trace = dir.join("trace");
    // 8 MiB (about 6,000 frames) that compress badly (xorshift), and their checksum.
    let data = dir.join("bulk");
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let bytes: Vec<u8> = (0..8 << 17)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    std::fs::write(&data, &bytes).unwrap();
    let sum = Command::new("sha256sum").arg(&data).output().unwrap();
    let expected = String::from_utf8_lossy(&sum.stdout)[..64].to_string();

    let ns = Netns::new("tcp");
    let config = config(&dir, "tcp_sink 5001");
    let mut rec = Recording::start(&ns, &config, &trace);
    rec.wait_for("tcp_sink: listening");
    let sender = ns.bash(&format!("cat {} > /dev/tcp/{GUEST}/5001", data.display()));
    assert!(sender.status.success(), "{sender:?}");
    let (status, stdout, stderr) = rec.finish();
    assert_eq!(status, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!(
            "tcp_sink: {} bytes, sha256 {expected}",
            bytes.len()
        )),
        "{stdout}"
    );
    drop(ns);
    assert_replays_without_a_network(&trace, &stdout);
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs root, /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_tap_device_that_disappears_is_reported_and_the_trace_replays() {
    network_ready();
    let dir = scratch("tap-gone");
    let trace = dir.join("trace");
    let ns = Netns::new("gone");
    // One sender that never says "end"; the sink gives up after 5 s.
    let config = config(&dir, "udp_sink 5000 1 /tmp/in 5");
    let mut rec = Recording::start(&ns, &config, &trace);
    rec.wait_for("udp_sink: listening");
    // A burst far larger than the guest's receive ring and insight's
    // queue together: what neither holds is dropped, and said.
    let sent = ns.bash(&format!(
        "for i in $(seq 1 3000); do echo \"a $i\" > /dev/udp/{GUEST}/5000; done"
    ));
    assert!(sent.status.success(), "{sent:?}");
    std::thread::sleep(Duration::from_millis(500));
    ip(&["netns", "exec", &ns.name, "ip", "link", "del", "insight0"]);
    let (status, stdout, stderr) = rec.finish();
    // The guest command failed (its sender vanished); insight did not.
    assert_eq!(status, Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("udp_sink: no datagram for 5 s"), "{stdout}");
    assert!(
        stderr.contains("network: the TAP device stopped working"),
        "{stderr}"
    );
    // The number stderr gives before `what`, if it says it.
    let count = |what: &str| -> Option<u64> {
        let (before, _) = stderr.split_once(what)?;
        before.rsplit(' ').next()?.parse().ok()
    };
    let queued = count(" received frames were dropped while the guest took none")
        .unwrap_or_else(|| panic!("no count of dropped frames: {stderr}"));
    assert!(queued > 0, "{stderr}");
    let dropped =
        queued + count(" frames for the guest were dropped by the host kernel").unwrap_or(0);
    // The trace says so too.
    let dump = insight()
        .arg("dump")
        .arg("--header")
        .arg(&trace)
        .output()
        .unwrap();
    let (header, _) = text(&dump);
    assert!(
        header.contains(&format!("dropped:    {dropped} received network frames")),
        "{header}"
    );
    drop(ns);
    // What was logged before the device went away is all there.
    assert_replays_without_a_network(&trace, &stdout);
    let _ = std::fs::remove_dir_all(&dir);
}
