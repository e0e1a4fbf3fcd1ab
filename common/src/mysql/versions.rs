//! The trigger-maintained version column on MariaDB (`version = "trigger"`): one SEQUENCE per
//! table (MariaDB 10.3+; MySQL has none, so it is refused there by name) and BEFORE INSERT and
//! BEFORE UPDATE triggers that give every written row the sequence's next value. Versions are
//! then monotone per key whatever the clocks do and across delete and re-insert: InnoDB
//! locks the row before a BEFORE UPDATE trigger runs, so two writers of one key take their
//! values in the order they write it.

use super::quote_ident;
use crate::config::TRIGGER_VERSION_COLUMN;
use crate::pg::{TableName, derived_name};

fn qualified(table: &TableName) -> String {
    format!("{}.{}", quote_ident(&table.schema), quote_ident(&table.name))
}

/// The table's version sequence: `<table>_tidemark_version_seq` in its database.
pub fn version_sequence(table: &TableName) -> TableName {
    TableName {
        schema: table.schema.clone(),
        name: derived_name("", &table.name, "_tidemark_version_seq"),
    }
}

/// The next version, as a trigger takes it.
pub fn next_version(table: &TableName) -> String {
    format!("NEXTVAL({})", qualified(&version_sequence(table)))
}

/// What `source install` runs for `version = "trigger"`, each step idempotent.
/// `has_column`: the version column exists already (a repeated install). `on_update`: the
/// table's `ON UPDATE CURRENT_TIMESTAMP` columns, which the one UPDATE that numbers the
/// existing rows sets to themselves so that it changes no application value.
pub fn install_statements(table: &TableName, has_column: bool, on_update: &[String]) -> Vec<String> {
    let column = quote_ident(TRIGGER_VERSION_COLUMN);
    let t = qualified(table);
    let schema = quote_ident(&table.schema);
    let mut statements = vec![format!(
        "CREATE SEQUENCE IF NOT EXISTS {} NOCACHE",
        qualified(&version_sequence(table))
    )];
    if !has_column {
        statements.push(format!("ALTER TABLE {t} ADD COLUMN {column} BIGINT NOT NULL DEFAULT 0"));
        let mut assignments = vec![format!("{column} = {}", next_version(table))];
        assignments.extend(on_update.iter().map(|c| format!("{0} = {0}", quote_ident(c))));
        statements.push(format!("UPDATE {t} SET {}", assignments.join(", ")));
    }
    for (prefix, event) in [
        ("tidemark_version_insert_", "INSERT"),
        ("tidemark_version_update_", "UPDATE"),
    ] {
        let trigger = quote_ident(&derived_name(prefix, &table.name, ""));
        statements.push(format!("DROP TRIGGER IF EXISTS {schema}.{trigger}"));
        statements.push(format!(
            "CREATE TRIGGER {schema}.{trigger} BEFORE {event} ON {t} FOR EACH ROW SET NEW.{column} = {}",
            next_version(table)
        ));
    }
    statements
}

/// The table's `ON UPDATE CURRENT_TIMESTAMP` columns (`?` database, `?` table).
pub const ON_UPDATE_COLUMNS: &str = "SELECT CAST(column_name AS CHAR) FROM information_schema.columns \
     WHERE table_schema = ? AND table_name = ? AND LOWER(extra) LIKE '%on update%'";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn existing_rows_are_numbered_without_touching_their_timestamps() {
        let table = TableName {
            schema: "shop".into(),
            name: "items".into(),
        };
        let statements = install_statements(&table, false, &["updated_at".to_string()]);
        assert_eq!(
            statements[0],
            "CREATE SEQUENCE IF NOT EXISTS `shop`.`items_tidemark_version_seq` NOCACHE"
        );
        assert_eq!(
            statements[2],
            "UPDATE `shop`.`items` SET `tidemark_row_version` = NEXTVAL(`shop`.`items_tidemark_version_seq`), \
             `updated_at` = `updated_at`"
        );
        assert!(statements[4].contains("BEFORE INSERT ON `shop`.`items` FOR EACH ROW SET NEW.`tidemark_row_version`"));
        let again = install_statements(&table, true, &[]);
        assert!(
            again
                .iter()
                .all(|s| !s.starts_with("ALTER") && !s.starts_with("UPDATE"))
        );
    }
}
