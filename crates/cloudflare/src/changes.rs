//! How [`Sql::execute`](durability_platform::Sql::execute) learns the
//! number of rows a statement changed without a second statement.
//!
//! The cursor's `rowsWritten` counts index rows too, so it is not the
//! contract's number; `SELECT changes()` is, but it is one more `sql.exec`
//! per write, and a statement costs far more in the runtime's binding
//! (a cursor object, its iterator, their garbage) than in SQLite. A write
//! with `RETURNING 1` appended returns one row per row it changed, and
//! SQLite counts those rows exactly as `changes()` does: the top-level
//! statement's rows, not a trigger's and not the rows a `REPLACE` conflict
//! deleted. [`returning_one`] appends it only where that is certain; every
//! other statement keeps `SELECT changes()`.
//!
//! Pure string work, so it is compiled and tested on every target.

/// `sql` with `RETURNING 1` appended, when the result is certain to be a
/// statement that returns one row per row it changes: one INSERT, REPLACE,
/// UPDATE or DELETE (the first word), with no `;` (a second statement), no
/// comment (which could swallow the appended words), no RETURNING of its
/// own, and no ORDER BY or LIMIT (RETURNING cannot follow them in an UPDATE
/// or DELETE). `None` for anything else, a `WITH` prefix included.
///
/// The checks read the raw text: a `;` or a keyword inside a string literal
/// or a quoted name makes the answer `None`, never a wrong statement.
pub(crate) fn returning_one(sql: &str) -> Option<String> {
    let trimmed = sql.trim();
    let first = trimmed.split_ascii_whitespace().next()?;
    let is_write = ["INSERT", "REPLACE", "UPDATE", "DELETE"]
        .iter()
        .any(|verb| first.eq_ignore_ascii_case(verb));
    if !is_write || trimmed.contains(';') || trimmed.contains("--") || trimmed.contains("/*") {
        return None;
    }
    let has_word = |word: &str| {
        trimmed
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|w| w.eq_ignore_ascii_case(word))
    };
    if ["RETURNING", "ORDER", "LIMIT"].into_iter().any(has_word) {
        return None;
    }
    Some(format!("{trimmed} RETURNING 1"))
}

#[cfg(test)]
mod tests {
    use super::returning_one;

    #[test]
    fn a_plain_write_gets_returning_one() {
        for sql in [
            "INSERT INTO t (a, b) VALUES (?, ?)",
            "insert or ignore into t (a) values (?)",
            "INSERT INTO t (a) VALUES (?) ON CONFLICT(a) DO UPDATE SET b = excluded.b",
            "REPLACE INTO t (a) VALUES (?)",
            "UPDATE t SET a = ? WHERE id = ? AND status = 'pending'",
            "DELETE FROM t WHERE seq BETWEEN ? AND ?",
            "  DELETE\n FROM t WHERE x IN (SELECT x FROM u)  ",
        ] {
            assert_eq!(
                returning_one(sql).as_deref(),
                Some(format!("{} RETURNING 1", sql.trim()).as_str()),
                "{sql}"
            );
        }
    }

    #[test]
    fn anything_uncertain_keeps_select_changes() {
        for sql in [
            "SELECT changes()",
            "CREATE TABLE t (a)",
            "PRAGMA user_version = 3",
            "WITH x AS (SELECT 1) INSERT INTO t SELECT * FROM x",
            "INSERT INTO t (a) VALUES (?);",
            "INSERT INTO t (a) VALUES (?); DELETE FROM t",
            "INSERT INTO t (a) VALUES (?) -- note",
            "INSERT INTO t (a) VALUES (?) /* note */",
            "INSERT INTO t (a) VALUES (?) RETURNING a",
            "DELETE FROM t WHERE a < ? ORDER BY a LIMIT 10",
            "UPDATE t SET a = 1 LIMIT 5",
            "INSERT INTO t SELECT a FROM u ORDER BY a",
            // Conservative on literals and quoted names: no count, no harm.
            "UPDATE t SET note = 'a; b' WHERE id = ?",
            "UPDATE t SET \"order\" = ? WHERE id = ?",
            "",
        ] {
            assert_eq!(returning_one(sql), None, "{sql}");
        }
    }
}
