//! Probes given at replay (`insight replay --probe SPEC`): the spec
//! language of docs/probes.md, parsed and checked for form. Whether the
//! function, object or variable it names exists is the caller's to check,
//! against the recording's files.
//!
//! ```text
//! spec     := location [entry | return] clause*
//! location := FUNCTION | OBJECT:FUNCTION | ADDRESS | OBJECT:ADDRESS | FILE:LINE
//! clause   := in PROCESS | in pid PID | capture item {, item} | if operand op NUMBER
//! item     := arg0..arg5 | retval | REGISTER | *argN:LEN | str(argN) | ustack | VARIABLE
//! operand  := arg0..arg5 | retval | REGISTER | VARIABLE
//! op       := == | != | < | <= | > | >=
//! ```

use std::fmt;

/// The most bytes `*argN:LEN` and `str(argN)` capture.
pub const MAX_CAPTURE_BYTES: u32 = 4096;
/// What `str(argN)` reads at most.
pub const MAX_STRING: u32 = 256;
/// The most probes one replay arms.
pub const MAX_PROBES: usize = 64;

/// The general-purpose registers a spec may name, in `kvm_regs` order of
/// the debugger's position (RAX, RCX, RDX, RBX, RSP, RBP, RSI, RDI,
/// R8..R15), then RIP.
pub const REGISTERS: [&str; 17] = [
    "rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi", "r8", "r9", "r10", "r11", "r12", "r13",
    "r14", "r15", "rip",
];
/// The System V AMD64 integer argument registers, as indexes of
/// [`REGISTERS`].
pub const ARG_REGISTERS: [usize; 6] = [7, 6, 2, 1, 8, 9];

/// A parsed probe spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeSpec {
    /// The spec as given (whitespace collapsed): how reports name it.
    pub text: String,
    pub location: ProbeLocation,
    pub at: ProbeAt,
    /// Which process (default: the recorded command's).
    pub process: Option<ProcessName>,
    pub captures: Vec<CaptureItem>,
    pub condition: Option<Condition>,
}

/// Where a probe goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeLocation {
    /// A function, in the executable or in `object` (a shared library's
    /// file name, or a path).
    Function {
        object: Option<String>,
        name: String,
    },
    /// An address: the executable's (as its symbols give it), or an
    /// offset in `object`'s.
    Address { object: Option<String>, addr: u64 },
    /// The first address of a source line (DWARF line table).
    Line { file: String, line: u32 },
}

impl ProbeLocation {
    /// The object it names, if not the executable.
    pub fn object(&self) -> Option<&str> {
        match self {
            ProbeLocation::Function { object, .. } | ProbeLocation::Address { object, .. } => {
                object.as_deref()
            }
            ProbeLocation::Line { .. } => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeAt {
    Entry,
    Return,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProcessName {
    Name(String),
    Pid(u32),
}

/// A value a probe records at each hit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaptureItem {
    /// An integer argument, by position (0..=5).
    Arg(u8),
    /// The return value (RAX at the return).
    Retval,
    /// A register, by its index in [`REGISTERS`].
    Reg(usize),
    /// `len` bytes of memory at an argument.
    Mem { arg: u8, len: u32 },
    /// A NUL-terminated string at an argument.
    Str(u8),
    /// The user stack's return addresses.
    Ustack,
    /// A global variable of the executable, by name (its symbol's size,
    /// at most 8 bytes, read as a little-endian integer).
    Global(String),
}

impl CaptureItem {
    /// Whether it is an integer (it can be compared and put in a
    /// histogram).
    pub fn is_scalar(&self) -> bool {
        matches!(
            self,
            CaptureItem::Arg(_)
                | CaptureItem::Retval
                | CaptureItem::Reg(_)
                | CaptureItem::Global(_)
        )
    }
}

impl fmt::Display for CaptureItem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaptureItem::Arg(n) => write!(f, "arg{n}"),
            CaptureItem::Retval => f.write_str("retval"),
            CaptureItem::Reg(i) => f.write_str(REGISTERS[*i]),
            CaptureItem::Mem { arg, len } => write!(f, "*arg{arg}:{len}"),
            CaptureItem::Str(n) => write!(f, "str(arg{n})"),
            CaptureItem::Ustack => f.write_str("ustack"),
            CaptureItem::Global(name) => f.write_str(name),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CmpOp {
    pub fn holds(self, a: i64, b: i64) -> bool {
        match self {
            CmpOp::Eq => a == b,
            CmpOp::Ne => a != b,
            CmpOp::Lt => a < b,
            CmpOp::Le => a <= b,
            CmpOp::Gt => a > b,
            CmpOp::Ge => a >= b,
        }
    }
}

/// `if OPERAND OP VALUE`: a hit counts only where it holds (values
/// compared as signed 64-bit integers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub operand: CaptureItem,
    pub op: CmpOp,
    pub value: i64,
}

/// Why a spec is malformed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("probe '{spec}': {why}")]
pub struct SpecError {
    pub spec: String,
    pub why: String,
}

impl ProbeSpec {
    /// Parses one spec.
    pub fn parse(text: &str) -> Result<ProbeSpec, SpecError> {
        let words: Vec<&str> = text.split_whitespace().collect();
        let spec = words.join(" ");
        let err = |why: String| SpecError {
            spec: spec.clone(),
            why,
        };
        let Some((&first, mut rest)) = words.split_first() else {
            return Err(err("empty: it names no function".into()));
        };
        let location = parse_location(first).map_err(err)?;
        let mut at = ProbeAt::Entry;
        if let Some((&w, tail)) = rest.split_first() {
            match w {
                "entry" => rest = tail,
                "return" => {
                    at = ProbeAt::Return;
                    rest = tail;
                }
                _ => {}
            }
        }
        let mut process = None;
        let mut captures: Vec<CaptureItem> = Vec::new();
        let mut condition = None;
        while let Some((&w, tail)) = rest.split_first() {
            rest = tail;
            match w {
                "in" => {
                    if process.is_some() {
                        return Err(err("'in' given twice".into()));
                    }
                    let (p, tail) = parse_process(rest).map_err(err)?;
                    process = Some(p);
                    rest = tail;
                }
                "capture" => {
                    // Items up to the next clause, separated by commas.
                    let end = rest
                        .iter()
                        .position(|w| matches!(*w, "in" | "if" | "capture"))
                        .unwrap_or(rest.len());
                    let list = rest[..end].join("");
                    rest = &rest[end..];
                    if list.is_empty() {
                        return Err(err("'capture' names nothing".into()));
                    }
                    for item in list.split(',') {
                        let item = parse_item(item).map_err(err)?;
                        if !captures.contains(&item) {
                            captures.push(item);
                        }
                    }
                }
                "if" => {
                    if condition.is_some() {
                        return Err(err("'if' given twice (one comparison per probe)".into()));
                    }
                    let end = rest
                        .iter()
                        .position(|w| matches!(*w, "in" | "capture" | "if"))
                        .unwrap_or(rest.len());
                    let expr = rest[..end].join("");
                    rest = &rest[end..];
                    condition = Some(parse_condition(&expr).map_err(err)?);
                }
                other => {
                    return Err(err(format!(
                        "'{other}' is not a clause (expected entry, return, in, capture or if)"
                    )))
                }
            }
        }
        let uses_retval = captures.contains(&CaptureItem::Retval)
            || condition
                .as_ref()
                .is_some_and(|c| c.operand == CaptureItem::Retval);
        if uses_retval && at == ProbeAt::Entry {
            return Err(err(
                "retval exists only at a function's return: add 'return'".into(),
            ));
        }
        if at == ProbeAt::Return && !matches!(location, ProbeLocation::Function { .. }) {
            return Err(err(
                "'return' needs a function (an address or a line has no return)".into(),
            ));
        }
        Ok(ProbeSpec {
            text: spec,
            location,
            at,
            process,
            captures,
            condition,
        })
    }

    /// Parses a probes file: one spec per line; blank lines and lines
    /// starting with `#` are skipped. Errors name the line.
    pub fn parse_file(text: &str) -> Result<Vec<ProbeSpec>, SpecError> {
        let mut out = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            out.push(ProbeSpec::parse(line).map_err(|e| SpecError {
                spec: e.spec,
                why: format!("line {}: {}", i + 1, e.why),
            })?);
        }
        Ok(out)
    }

    /// The names of the captured values, in order (how reports and the
    /// database's slots name them).
    pub fn capture_names(&self) -> Vec<String> {
        self.captures.iter().map(ToString::to_string).collect()
    }
}

fn parse_number(s: &str) -> Option<i64> {
    let (neg, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s),
    };
    let v = match digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        Some(hex) => u64::from_str_radix(hex, 16).ok()? as i64,
        None => digits.parse::<u64>().ok()? as i64,
    };
    Some(if neg { v.wrapping_neg() } else { v })
}

fn parse_address(s: &str) -> Option<u64> {
    let hex = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X"))?;
    u64::from_str_radix(hex, 16).ok()
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '@')
}

fn parse_location(s: &str) -> Result<ProbeLocation, String> {
    if let Some(addr) = parse_address(s) {
        return Ok(ProbeLocation::Address { object: None, addr });
    }
    if let Some((left, right)) = s.rsplit_once(':') {
        if left.is_empty() || right.is_empty() {
            return Err(format!("'{s}' is not OBJECT:FUNCTION or FILE:LINE"));
        }
        if right.bytes().all(|b| b.is_ascii_digit()) {
            let line = right
                .parse::<u32>()
                .ok()
                .filter(|&l| l > 0)
                .ok_or_else(|| format!("'{right}' is not a line number"))?;
            return Ok(ProbeLocation::Line {
                file: left.to_owned(),
                line,
            });
        }
        let object = Some(left.to_owned());
        if let Some(addr) = parse_address(right) {
            return Ok(ProbeLocation::Address { object, addr });
        }
        if !is_identifier(right) {
            return Err(format!("'{right}' is not a function name"));
        }
        return Ok(ProbeLocation::Function {
            object,
            name: right.to_owned(),
        });
    }
    if !is_identifier(s) {
        return Err(format!(
            "'{s}' is not a function name, an address (0x...), OBJECT:FUNCTION or FILE:LINE"
        ));
    }
    Ok(ProbeLocation::Function {
        object: None,
        name: s.to_owned(),
    })
}

fn parse_process<'a>(rest: &'a [&'a str]) -> Result<(ProcessName, &'a [&'a str]), String> {
    match rest {
        ["pid", pid, tail @ ..] => {
            let pid = pid
                .parse::<u32>()
                .ok()
                .filter(|&p| p > 0)
                .ok_or_else(|| format!("'{pid}' is not a pid"))?;
            Ok((ProcessName::Pid(pid), tail))
        }
        [name, tail @ ..] if !matches!(*name, "capture" | "if") => {
            Ok((ProcessName::Name((*name).to_owned()), tail))
        }
        _ => Err("'in' names no process (a program name, or 'pid N')".into()),
    }
}

fn parse_arg(s: &str) -> Option<u8> {
    let n = s.strip_prefix("arg")?;
    (n.len() == 1)
        .then(|| n.parse::<u8>().ok())
        .flatten()
        .filter(|&n| n < 6)
}

fn parse_item(s: &str) -> Result<CaptureItem, String> {
    if s.is_empty() {
        return Err("an empty capture item (two commas?)".into());
    }
    if let Some(n) = parse_arg(s) {
        return Ok(CaptureItem::Arg(n));
    }
    if s == "retval" {
        return Ok(CaptureItem::Retval);
    }
    if s == "ustack" {
        return Ok(CaptureItem::Ustack);
    }
    if let Some(i) = REGISTERS.iter().position(|r| *r == s) {
        return Ok(CaptureItem::Reg(i));
    }
    if let Some(inner) = s.strip_prefix("str(").and_then(|r| r.strip_suffix(')')) {
        let arg =
            parse_arg(inner).ok_or_else(|| format!("str() takes arg0..arg5, not '{inner}'"))?;
        return Ok(CaptureItem::Str(arg));
    }
    if let Some(mem) = s.strip_prefix('*') {
        let (arg, len) = mem
            .split_once(':')
            .ok_or_else(|| format!("'{s}': memory is *argN:LEN"))?;
        let arg = parse_arg(arg).ok_or_else(|| format!("'{s}': memory is read at arg0..arg5"))?;
        let len = len
            .parse::<u32>()
            .ok()
            .filter(|l| (1..=MAX_CAPTURE_BYTES).contains(l))
            .ok_or_else(|| format!("'{s}': LEN must be 1 to {MAX_CAPTURE_BYTES} bytes"))?;
        return Ok(CaptureItem::Mem { arg, len });
    }
    if s.starts_with("arg") && s[3..].bytes().all(|b| b.is_ascii_digit()) && s.len() > 3 {
        return Err(format!("'{s}': the arguments are arg0 to arg5"));
    }
    if is_identifier(s) {
        return Ok(CaptureItem::Global(s.to_owned()));
    }
    Err(format!(
        "'{s}' is not something to capture (argN, retval, a register, *argN:LEN, str(argN), \
         ustack or a global variable)"
    ))
}

fn parse_condition(expr: &str) -> Result<Condition, String> {
    const OPS: [(&str, CmpOp); 6] = [
        ("==", CmpOp::Eq),
        ("!=", CmpOp::Ne),
        ("<=", CmpOp::Le),
        (">=", CmpOp::Ge),
        ("<", CmpOp::Lt),
        (">", CmpOp::Gt),
    ];
    let Some((at, text, op)) = OPS
        .iter()
        .filter_map(|(text, op)| expr.find(text).map(|at| (at, *text, *op)))
        .min_by_key(|(at, text, _)| (*at, std::cmp::Reverse(text.len())))
    else {
        return Err(format!(
            "'if {expr}': expected OPERAND OP NUMBER with OP one of == != < <= > >="
        ));
    };
    let (left, right) = (&expr[..at], &expr[at + text.len()..]);
    let operand = parse_item(left)?;
    if !operand.is_scalar() {
        return Err(format!(
            "'if {expr}': {operand} is not an integer (compare an argument, retval, a register \
             or a variable)"
        ));
    }
    let value =
        parse_number(right).ok_or_else(|| format!("'if {expr}': '{right}' is not a number"))?;
    Ok(Condition { operand, op, value })
}

/// The candidates closest to `name` (edit distance at most a third of
/// its length, at least 2), best first, at most `n`: what an error about
/// an unknown name suggests.
pub fn nearest<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
    n: usize,
) -> Vec<String> {
    let limit = (name.len() / 3).max(2);
    let mut scored: Vec<(usize, &str)> = candidates
        .into_iter()
        .filter_map(|c| {
            let d = edit_distance(name, c);
            let contains = c.contains(name) || name.contains(c);
            (d <= limit || (contains && c.len() > 2)).then_some((d, c))
        })
        .collect();
    scored.sort();
    scored.dedup_by(|a, b| a.1 == b.1);
    scored
        .into_iter()
        .take(n)
        .map(|(_, c)| c.to_owned())
        .collect()
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smallest_spec_counts_a_function_at_entry() {
        let p = ProbeSpec::parse("parse").unwrap();
        assert_eq!(
            p.location,
            ProbeLocation::Function {
                object: None,
                name: "parse".into()
            }
        );
        assert_eq!(p.at, ProbeAt::Entry);
        assert!(p.captures.is_empty() && p.condition.is_none() && p.process.is_none());
    }

    #[test]
    fn every_clause_parses() {
        let p = ProbeSpec::parse(
            "libc.so.6:write  return in pid 7 capture arg0, *arg1:64,str(arg1),retval,ustack,r12,counter if arg2 >= 0x10",
        )
        .unwrap();
        assert_eq!(p.location.object(), Some("libc.so.6"));
        assert_eq!(p.at, ProbeAt::Return);
        assert_eq!(p.process, Some(ProcessName::Pid(7)));
        assert_eq!(
            p.capture_names(),
            [
                "arg0",
                "*arg1:64",
                "str(arg1)",
                "retval",
                "ustack",
                "r12",
                "counter"
            ]
        );
        assert_eq!(
            p.condition,
            Some(Condition {
                operand: CaptureItem::Arg(2),
                op: CmpOp::Ge,
                value: 16
            })
        );
        assert!(p.text.starts_with("libc.so.6:write return in pid 7"));
        let q = ProbeSpec::parse("work in worker if arg0<-3").unwrap();
        assert_eq!(q.process, Some(ProcessName::Name("worker".into())));
        let c = q.condition.unwrap();
        assert_eq!((c.op, c.value), (CmpOp::Lt, -3));
        assert!(c.op.holds(-4, -3) && !c.op.holds(-3, -3));
    }

    #[test]
    fn locations_are_functions_addresses_or_lines() {
        let at = |s: &str| ProbeSpec::parse(s).unwrap().location;
        assert_eq!(
            at("0x401000"),
            ProbeLocation::Address {
                object: None,
                addr: 0x401000
            }
        );
        assert_eq!(
            at("libfoo.so:0x1234"),
            ProbeLocation::Address {
                object: Some("libfoo.so".into()),
                addr: 0x1234
            }
        );
        assert_eq!(
            at("main.c:42"),
            ProbeLocation::Line {
                file: "main.c".into(),
                line: 42
            }
        );
        assert_eq!(
            at("/usr/lib/x86_64-linux-gnu/libc.so.6:fsync").object(),
            Some("/usr/lib/x86_64-linux-gnu/libc.so.6")
        );
    }

    #[test]
    fn malformed_specs_say_what_is_wrong() {
        let why = |s: &str| ProbeSpec::parse(s).unwrap_err().why;
        assert!(why("").contains("empty"));
        assert!(why("f capture").contains("names nothing"));
        assert!(why("f capture arg6").contains("arg0 to arg5"));
        assert!(why("f capture retval").contains("add 'return'"));
        assert!(why("f if retval > 1").contains("add 'return'"));
        assert!(why("f capture *arg0:0").contains("LEN"));
        assert!(why("f capture *arg0:99999").contains("LEN"));
        assert!(why("f if arg0 ~ 3").contains("OP one of"));
        assert!(why("f if arg0 > x").contains("not a number"));
        assert!(why("f if ustack > 1").contains("not an integer"));
        assert!(why("f if arg0 > 1 if arg1 > 2").contains("twice"));
        assert!(why("f in").contains("names no process"));
        assert!(why("f in pid x").contains("not a pid"));
        assert!(why("f bogus").contains("not a clause"));
        assert!(why("0x10 return").contains("needs a function"));
        assert!(why("main.c:0").contains("line number"));
        assert!(why("f-g").contains("not a function name"));
    }

    #[test]
    fn files_skip_comments_and_name_the_bad_line() {
        let specs =
            ProbeSpec::parse_file("# probes\n\nparse\n  compress return capture retval\n").unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[1].at, ProbeAt::Return);
        let e = ProbeSpec::parse_file("parse\nf capture\n").unwrap_err();
        assert!(e.why.starts_with("line 2:"), "{e}");
    }

    #[test]
    fn nearest_names_come_first() {
        let names = ["parse_request", "parse_reply", "compress", "main"];
        assert_eq!(
            nearest("parse_requst", names, 2),
            ["parse_request", "parse_reply"]
        );
        assert_eq!(nearest("compres", names, 3), ["compress"]);
        assert!(nearest("zzzzzz", names, 3).is_empty());
    }
}
