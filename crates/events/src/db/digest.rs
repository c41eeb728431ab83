//! The checksums of an event database (schema version 3): each packed
//! block carries the CRC-32 of its columns, and the `digest` key of `meta`
//! holds a CRC-32 of every table's content, so that a changed, added or
//! deleted row anywhere (a metadata key, a thread name, a block) is found
//! when the database is opened, naming the table.

use std::path::Path;

use rusqlite::types::ValueRef;
use rusqlite::Connection;

use super::{sql, DbError};

/// The `meta` key of the table digests.
pub const DIGEST_KEY: &str = "digest";

/// The tables covered, in the order their digests are listed (the probe
/// tables only where the database has them: version 4).
const TABLES: [&str; 10] = [
    "meta",
    "kinds",
    "events",
    "threads",
    "objects",
    "event_blocks",
    "stacks",
    "anomalies",
    "probes",
    "probe_values",
];

/// Whether the database has `table`.
fn has_table(conn: &Connection, path: &Path, table: &str) -> Result<bool, DbError> {
    conn.query_row(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
        [table],
        |r| r.get::<_, i64>(0),
    )
    .map(|n| n > 0)
    .map_err(sql(path))
}

/// CRC-32 of a packed block's row.
pub fn block_crc(first_seq: i64, count: i64, first_time: i64, last_time: i64, data: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for v in [first_seq, count, first_time, last_time] {
        h.update(&v.to_le_bytes());
    }
    h.update(data);
    h.finalize()
}

/// "table:crc32,..." over every covered table's rows (meta without its
/// digest key), each table in the order of all its columns.
pub fn table_digests(conn: &Connection, path: &Path) -> Result<String, DbError> {
    let mut out = Vec::new();
    for table in TABLES {
        if table.starts_with("probe") && !has_table(conn, path, table)? {
            continue;
        }
        let columns = conn
            .prepare(&format!("SELECT * FROM {table}"))
            .map_err(sql(path))?
            .column_count();
        let order: Vec<String> = (1..=columns).map(|i| i.to_string()).collect();
        let filter = if table == "meta" {
            format!("WHERE key != '{DIGEST_KEY}'")
        } else {
            String::new()
        };
        let mut stmt = conn
            .prepare(&format!(
                "SELECT * FROM {table} {filter} ORDER BY {}",
                order.join(",")
            ))
            .map_err(sql(path))?;
        let mut rows = stmt.query([]).map_err(sql(path))?;
        let mut h = crc32fast::Hasher::new();
        while let Some(row) = rows.next().map_err(sql(path))? {
            for i in 0..columns {
                match row.get_ref(i).map_err(sql(path))? {
                    ValueRef::Null => h.update(&[0]),
                    ValueRef::Integer(v) => {
                        h.update(&[1]);
                        h.update(&v.to_le_bytes());
                    }
                    ValueRef::Real(v) => {
                        h.update(&[2]);
                        h.update(&v.to_le_bytes());
                    }
                    ValueRef::Text(b) | ValueRef::Blob(b) => {
                        h.update(&[3]);
                        h.update(&(b.len() as u64).to_le_bytes());
                        h.update(b);
                    }
                }
            }
        }
        out.push(format!("{table}:{:08x}", h.finalize()));
    }
    Ok(out.join(","))
}

/// Checks `stored` (the `digest` value) against the content; the error
/// names the first table that differs.
pub fn check(conn: &Connection, path: &Path, stored: Option<&str>) -> Result<(), DbError> {
    let corrupt = |what: String| DbError::Corrupt {
        path: path.to_owned(),
        what,
    };
    let Some(stored) = stored else {
        return Err(corrupt(format!(
            "its meta table has no '{DIGEST_KEY}' (every version 3 database has one)"
        )));
    };
    let computed = table_digests(conn, path)?;
    let stored_tables: Vec<&str> = stored.split(',').collect();
    for (i, now) in computed.split(',').enumerate() {
        if stored_tables.get(i) != Some(&now) {
            let table = now.split(':').next().unwrap_or(now);
            return Err(corrupt(format!(
                "the content of its {table} table does not match its checksum"
            )));
        }
    }
    if stored_tables.len() != computed.split(',').count() {
        return Err(corrupt(format!("its '{DIGEST_KEY}' is malformed")));
    }
    Ok(())
}
