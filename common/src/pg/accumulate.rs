//! SQL of an `accumulate` task's target: the summary table keyed by `group_by`, the
//! session-local table a batch's deltas are copied into, and the statement that folds them
//! into the running totals (`count = count + delta`) in the batch's one transaction.

use super::{TableSql, quote_ident};
use crate::transform::{AccumulateSpec, AggregateFunction};

/// The weight column of the delta table: how many elements share the row's key.
pub const WEIGHT_COLUMN: &str = "_tidemark_weight";

/// An accumulate task's statements.
pub struct AccumulateSql<'a> {
    pub table: &'a TableSql,
    pub spec: &'a AccumulateSpec,
}

impl AccumulateSql<'_> {
    fn source_type(&self, column: &str) -> Option<&str> {
        self.table
            .columns
            .iter()
            .find(|c| c.name == column)
            .map(|c| c.sql_type.as_str())
    }

    /// The type of a group column in the target: text for the exploded element, the source
    /// column's type otherwise.
    fn group_type(&self, column: &str) -> String {
        match &self.spec.explode {
            Some(explode) if explode.as_column == column => "text".to_string(),
            _ => self.source_type(column).unwrap_or("text").to_string(),
        }
    }

    fn groups(&self) -> Vec<String> {
        self.spec.group_by.iter().map(|g| quote_ident(g)).collect()
    }

    /// `(name, input column)` of the aggregates that read a column, in delta-key order.
    fn inputs(&self) -> impl Iterator<Item = (usize, &str)> {
        self.spec
            .aggregates
            .iter()
            .filter_map(|a| a.column.as_deref())
            .enumerate()
    }

    fn input_column(index: usize) -> String {
        quote_ident(&format!("_tidemark_in_{index}"))
    }

    /// The summary table, created when missing.
    /// Empties the summary table: a new epoch counts every row again.
    pub fn reset_totals(&self) -> String {
        format!("DELETE FROM {}", self.table.target.quoted())
    }

    pub fn create_target_table(&self) -> String {
        let mut definitions: Vec<String> = self
            .spec
            .group_by
            .iter()
            .map(|g| format!("{} {} NOT NULL", quote_ident(g), self.group_type(g)))
            .collect();
        for aggregate in &self.spec.aggregates {
            let sql_type = match (aggregate.function, &aggregate.column) {
                (AggregateFunction::Count, _) => "bigint NOT NULL DEFAULT 0".to_string(),
                (AggregateFunction::Sum, _) => "numeric NOT NULL DEFAULT 0".to_string(),
                (_, Some(column)) => self.source_type(column).unwrap_or("numeric").to_string(),
                (_, None) => "numeric".to_string(),
            };
            definitions.push(format!("{} {sql_type}", quote_ident(&aggregate.name)));
        }
        definitions.push(format!("PRIMARY KEY ({})", self.groups().join(", ")));
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({})",
            self.table.target.quoted(),
            definitions.join(", ")
        )
    }

    pub fn delta_table(&self) -> String {
        quote_ident(&super::derived_name("tidemark_delta_", &self.table.target.name, ""))
    }

    /// Group columns typed as the target's (a value the target rejects fails its COPY), the
    /// aggregate inputs as text, and the weight.
    pub fn create_delta_table(&self) -> String {
        let mut list = self.groups();
        list.extend(
            self.inputs()
                .map(|(i, _)| format!("NULL::text AS {}", Self::input_column(i))),
        );
        list.push(format!("NULL::bigint AS {}", quote_ident(WEIGHT_COLUMN)));
        format!(
            "CREATE TEMP TABLE IF NOT EXISTS {} ON COMMIT DELETE ROWS AS SELECT {} FROM {} WITH NO DATA",
            self.delta_table(),
            list.join(", "),
            self.table.target.quoted()
        )
    }

    pub fn copy_into_delta(&self) -> String {
        let mut columns = self.groups();
        columns.extend(self.inputs().map(|(i, _)| Self::input_column(i)));
        columns.push(quote_ident(WEIGHT_COLUMN));
        format!("COPY {} ({}) FROM STDIN", self.delta_table(), columns.join(", "))
    }

    pub fn clear_delta(&self) -> String {
        format!("DELETE FROM {}", self.delta_table())
    }

    /// Folds the batch's deltas into the totals. Rows are locked in group order, so
    /// concurrent batches of other shards never deadlock on shared groups.
    pub fn accumulate(&self) -> String {
        let groups = self.groups();
        let weight = quote_ident(WEIGHT_COLUMN);
        let mut columns = groups.clone();
        let mut values = groups.clone();
        let mut updates = Vec::new();
        let mut input = 0;
        for aggregate in &self.spec.aggregates {
            let name = quote_ident(&aggregate.name);
            let source_type = aggregate
                .column
                .as_deref()
                .and_then(|c| self.source_type(c))
                .unwrap_or("numeric");
            let (value, merge) = match aggregate.function {
                AggregateFunction::Count => (format!("sum({weight})::bigint"), format!("t.{name} + EXCLUDED.{name}")),
                AggregateFunction::Sum => (
                    format!("coalesce(sum({}::numeric * {weight}), 0)", Self::input_column(input)),
                    format!("t.{name} + EXCLUDED.{name}"),
                ),
                AggregateFunction::Min => (
                    format!("min({}::{source_type})", Self::input_column(input)),
                    format!("LEAST(t.{name}, EXCLUDED.{name})"),
                ),
                AggregateFunction::Max => (
                    format!("max({}::{source_type})", Self::input_column(input)),
                    format!("GREATEST(t.{name}, EXCLUDED.{name})"),
                ),
            };
            if aggregate.column.is_some() {
                input += 1;
            }
            columns.push(name.clone());
            values.push(value);
            updates.push(format!("{name} = {merge}"));
        }
        format!(
            "INSERT INTO {target} AS t ({columns}) SELECT {values} FROM {delta} GROUP BY {groups} ORDER BY {groups} \
             ON CONFLICT ({groups}) DO UPDATE SET {updates}",
            target = self.table.target.quoted(),
            columns = columns.join(", "),
            values = values.join(", "),
            delta = self.delta_table(),
            groups = groups.join(", "),
            updates = updates.join(", "),
        )
    }

    /// The columns an existing summary table must have.
    pub fn required_columns(&self) -> Vec<String> {
        let mut names = self.spec.group_by.clone();
        names.extend(self.spec.aggregates.iter().map(|a| a.name.clone()));
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pg::{Column, TableName};
    use crate::transform::{Aggregate, Explode};

    #[test]
    fn accumulates_in_group_order_and_adds() {
        let table = TableSql {
            source: TableName::parse("events").unwrap(),
            target: TableName::parse("app_stat").unwrap(),
            columns: vec![
                Column {
                    name: "id".into(),
                    sql_type: "bigint".into(),
                },
                Column {
                    name: "amount".into(),
                    sql_type: "integer".into(),
                },
            ],
            key_columns: vec!["id".into()],
            cursor_column: None,
            version_column: Some("id".into()),
            deletes: None,
            filter: None,
            page_format: crate::copy_format::CopyFormat::Text,
            cursor_zone: None,
        };
        let spec = AccumulateSpec {
            explode: Some(Explode {
                path: "$.apps[*]".into(),
                from: "event".into(),
                as_column: "app".into(),
            }),
            group_by: vec!["app".into()],
            aggregates: vec![
                Aggregate::parse("n", "count").unwrap(),
                Aggregate::parse("total", "sum(amount)").unwrap(),
                Aggregate::parse("top", "max(amount)").unwrap(),
            ],
        };
        let sql = AccumulateSql {
            table: &table,
            spec: &spec,
        };
        let statement = sql.accumulate();
        assert!(
            statement.contains("ORDER BY \"app\" ON CONFLICT (\"app\")"),
            "{statement}"
        );
        assert!(statement.contains("\"n\" = t.\"n\" + EXCLUDED.\"n\""), "{statement}");
        assert!(
            statement.contains("coalesce(sum(\"_tidemark_in_0\"::numeric * \"_tidemark_weight\"), 0)"),
            "{statement}"
        );
        assert!(statement.contains("max(\"_tidemark_in_1\"::integer)"), "{statement}");
        let ddl = sql.create_target_table();
        assert!(
            ddl.contains("\"app\" text NOT NULL") && ddl.contains("\"top\" integer"),
            "{ddl}"
        );
    }
}
