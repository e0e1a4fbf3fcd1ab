//! The declarative transform of an `accumulate` task (seed 003): each source row is exploded
//! into elements by a JSON path, each element grouped by `group_by`, and the batch's elements
//! folded into per-group weights ([`Deltas`]) that the target adds to its running totals.
//!
//! A row that cannot be transformed (malformed JSON, a path step that meets the wrong JSON
//! type) is a [`RowError`]: it goes to the dead letters, never silently away.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::copy_text;
use crate::pg::Column;

/// What an `accumulate` task computes, as config states it and `TaskSpec` carries it (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccumulateSpec {
    #[serde(default)]
    pub explode: Option<Explode>,
    /// Target columns that key the running totals: source columns or the explode's `as`.
    pub group_by: Vec<String>,
    /// Target columns holding the totals, in config order.
    pub aggregates: Vec<Aggregate>,
}

/// `transform = { explode = "$.apps[*].name", from = "event", as = "app_name" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Explode {
    /// The JSON path whose selected scalars are the elements.
    #[serde(rename = "explode")]
    pub path: String,
    pub from: String,
    #[serde(rename = "as")]
    pub as_column: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Aggregate {
    pub name: String,
    pub function: AggregateFunction,
    /// The source column summed, minimized or maximized (`None` for `count`).
    pub column: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AggregateFunction {
    Count,
    Sum,
    Min,
    Max,
}

impl Aggregate {
    /// `count`, `sum(col)`, `min(col)` or `max(col)`.
    pub fn parse(name: &str, text: &str) -> Result<Aggregate, String> {
        let text = text.trim();
        if text == "count" || text == "count(*)" {
            return Ok(Aggregate {
                name: name.to_string(),
                function: AggregateFunction::Count,
                column: None,
            });
        }
        let bad = || format!("aggregate {name:?} = {text:?}: expected count, sum(column), min(column) or max(column)");
        let (function, rest) = text.split_once('(').ok_or_else(bad)?;
        let column = rest.strip_suffix(')').ok_or_else(bad)?.trim();
        let function = match function.trim() {
            "sum" => AggregateFunction::Sum,
            "min" => AggregateFunction::Min,
            "max" => AggregateFunction::Max,
            _ => return Err(bad()),
        };
        if column.is_empty() {
            return Err(bad());
        }
        Ok(Aggregate {
            name: name.to_string(),
            function,
            column: Some(column.to_string()),
        })
    }
}

/// Why one row could not be transformed or written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowError {
    /// `malformed_json`, `transform_error`, or the target's condition name (see
    /// `pg::dead_letters::row_error_class`).
    pub class: String,
    pub message: String,
}

impl RowError {
    pub fn new(class: &str, message: impl Into<String>) -> RowError {
        RowError {
            class: class.to_string(),
            message: message.into(),
        }
    }
}

/// A parsed JSON path: `$`, then `.name`, `["name"]`, `[*]` or `[n]` steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPath {
    text: String,
    steps: Vec<Step>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Member(String),
    Every,
    Index(usize),
}

impl JsonPath {
    pub fn parse(text: &str) -> Result<JsonPath, String> {
        let bad = |why: &str| format!("JSON path {text:?}: {why}");
        let rest = text.trim().strip_prefix('$').ok_or_else(|| bad("must start with $"))?;
        let mut steps = Vec::new();
        let mut chars = rest.char_indices().peekable();
        while let Some((_, c)) = chars.next() {
            match c {
                '.' => {
                    let mut name = String::new();
                    while let Some((_, c)) = chars.peek() {
                        if *c == '.' || *c == '[' {
                            break;
                        }
                        name.push(*c);
                        chars.next();
                    }
                    if name.is_empty() {
                        return Err(bad("empty member name after '.'"));
                    }
                    steps.push(Step::Member(name));
                }
                '[' => {
                    let mut inner = String::new();
                    let mut closed = false;
                    for (_, c) in chars.by_ref() {
                        if c == ']' {
                            closed = true;
                            break;
                        }
                        inner.push(c);
                    }
                    if !closed {
                        return Err(bad("unclosed '['"));
                    }
                    let inner = inner.trim();
                    let quoted = |q: char| inner.len() >= 2 && inner.starts_with(q) && inner.ends_with(q);
                    if inner == "*" {
                        steps.push(Step::Every);
                    } else if quoted('"') || quoted('\'') {
                        steps.push(Step::Member(inner[1..inner.len() - 1].to_string()));
                    } else {
                        let index = inner
                            .parse::<usize>()
                            .map_err(|_| bad("a bracket holds *, an index or a quoted name"))?;
                        steps.push(Step::Index(index));
                    }
                }
                other => return Err(bad(&format!("unexpected {other:?}"))),
            }
        }
        Ok(JsonPath {
            text: text.trim().to_string(),
            steps,
        })
    }

    /// The scalar values the path selects, as text (strings as they are, numbers and booleans
    /// as JSON prints them). A missing member or a `null` selects nothing; a step that meets
    /// the wrong type (`[*]` on an object, `.name` on an array) or a selected object or array
    /// is an error.
    pub fn select(&self, document: &Value) -> Result<Vec<String>, String> {
        let mut current: Vec<&Value> = vec![document];
        let mut at = String::from("$");
        for step in &self.steps {
            let mut next = Vec::with_capacity(current.len());
            for value in current {
                match (step, value) {
                    (_, Value::Null) => {}
                    (Step::Member(name), Value::Object(map)) => next.extend(map.get(name)),
                    (Step::Every, Value::Array(items)) => next.extend(items.iter()),
                    (Step::Index(i), Value::Array(items)) => next.extend(items.get(*i)),
                    (Step::Member(name), other) => {
                        return Err(format!(
                            "{at}: expected an object with member {name:?}, found {}",
                            kind(other)
                        ));
                    }
                    (Step::Every | Step::Index(_), other) => {
                        return Err(format!("{at}: expected an array, found {}", kind(other)));
                    }
                }
            }
            match step {
                Step::Member(name) => at.push_str(&format!(".{name}")),
                Step::Every => at.push_str("[*]"),
                Step::Index(i) => at.push_str(&format!("[{i}]")),
            }
            current = next;
        }
        let mut out = Vec::with_capacity(current.len());
        for value in current {
            match value {
                Value::Null => {}
                Value::String(s) => out.push(s.clone()),
                Value::Number(n) => out.push(n.to_string()),
                Value::Bool(b) => out.push(b.to_string()),
                other => return Err(format!("{}: selects {}, not a scalar", self.text, kind(other))),
            }
        }
        Ok(out)
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Where a delta row's fields come from.
#[derive(Debug, Clone)]
enum Source {
    /// The exploded element.
    Element,
    /// A field of the staged row.
    Field(usize),
}

/// An [`AccumulateSpec`] bound to the staged row layout (the source columns in order).
#[derive(Debug, Clone)]
pub struct RowTransform {
    explode: Option<(JsonPath, usize)>,
    /// Group columns, then the inputs of the non-count aggregates.
    fields: Vec<Source>,
}

/// One element's delta key: group values, then aggregate inputs (`None`: SQL NULL).
pub type DeltaKey = Vec<Option<String>>;

impl RowTransform {
    pub fn new(spec: &AccumulateSpec, columns: &[Column]) -> Result<RowTransform, String> {
        let position = |name: &str, what: &str| {
            columns
                .iter()
                .position(|c| c.name == name)
                .ok_or_else(|| format!("{what} {name:?} is not a source column"))
        };
        let explode = match &spec.explode {
            Some(explode) => Some((
                JsonPath::parse(&explode.path)?,
                position(&explode.from, "transform.from")?,
            )),
            None => None,
        };
        let mut fields = Vec::new();
        for group in &spec.group_by {
            match &spec.explode {
                Some(explode) if &explode.as_column == group => fields.push(Source::Element),
                _ => fields.push(Source::Field(position(group, "group_by column")?)),
            }
        }
        for aggregate in &spec.aggregates {
            if let Some(column) = &aggregate.column {
                fields.push(Source::Field(position(column, "aggregate column")?));
            }
        }
        Ok(RowTransform { explode, fields })
    }

    /// The delta keys one staged row contributes (one per exploded element; one when nothing
    /// is exploded), or why it cannot contribute.
    pub fn elements(&self, row: &[u8]) -> Result<Vec<DeltaKey>, RowError> {
        let fields: Vec<&[u8]> = row.split(|b| *b == b'\t').collect();
        let field = |index: usize| -> Result<Option<String>, RowError> {
            let raw = fields
                .get(index)
                .ok_or_else(|| RowError::new("bad_row", format!("the row has no field {index}")))?;
            copy_text::decode_field(raw).map_err(|e| RowError::new("bad_row", e))
        };
        let elements: Vec<Option<String>> = match &self.explode {
            None => vec![None],
            Some((path, from)) => match field(*from)? {
                None => Vec::new(),
                Some(text) => {
                    let document: Value = serde_json::from_str(&text)
                        .map_err(|e| RowError::new("malformed_json", format!("malformed JSON: {e}")))?;
                    path.select(&document)
                        .map_err(|e| RowError::new("transform_error", e))?
                        .into_iter()
                        .map(Some)
                        .collect()
                }
            },
        };
        let mut fixed: Vec<Option<Option<String>>> = Vec::with_capacity(self.fields.len());
        for source in &self.fields {
            fixed.push(match source {
                Source::Element => None,
                Source::Field(index) => Some(field(*index)?),
            });
        }
        let mut keys = Vec::with_capacity(elements.len());
        for element in elements {
            let key: DeltaKey = fixed
                .iter()
                .map(|f| match f {
                    Some(value) => value.clone(),
                    None => element.clone(),
                })
                .collect();
            keys.push(key);
        }
        Ok(keys)
    }
}

/// A batch's elements folded by key: the weight is how many elements share the key. Bounded
/// by the batch, never by the table.
#[derive(Debug, Default)]
pub struct Deltas {
    weights: HashMap<DeltaKey, i64>,
}

impl Deltas {
    pub fn add(&mut self, keys: impl IntoIterator<Item = DeltaKey>) {
        for key in keys {
            *self.weights.entry(key).or_insert(0) += 1;
        }
    }

    /// Deltas of the given entries (as [`Deltas::entries`] lists them).
    pub fn from_entries<'a>(entries: impl IntoIterator<Item = (&'a DeltaKey, i64)>) -> Deltas {
        Deltas {
            weights: entries.into_iter().map(|(k, w)| (k.clone(), w)).collect(),
        }
    }

    /// Every key with its weight, in key order.
    pub fn entries(&self) -> Vec<(&DeltaKey, i64)> {
        let mut entries: Vec<(&DeltaKey, i64)> = self.weights.iter().map(|(k, w)| (k, *w)).collect();
        entries.sort();
        entries
    }

    pub fn is_empty(&self) -> bool {
        self.weights.is_empty()
    }

    pub fn len(&self) -> usize {
        self.weights.len()
    }

    /// COPY text rows: the key's fields, then the weight.
    pub fn to_copy_text(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.weights.len() * 32);
        for (key, weight) in &self.weights {
            for value in key {
                match value {
                    Some(text) => copy_text::encode_field(text, &mut out),
                    None => out.extend_from_slice(copy_text::NULL_FIELD),
                }
                out.push(b'\t');
            }
            out.extend_from_slice(weight.to_string().as_bytes());
            out.push(b'\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn columns() -> Vec<Column> {
        ["id", "type", "event", "_v"]
            .iter()
            .map(|n| Column {
                name: n.to_string(),
                sql_type: "text".into(),
            })
            .collect()
    }

    fn spec() -> AccumulateSpec {
        AccumulateSpec {
            explode: Some(Explode {
                path: "$.apps[*].name".into(),
                from: "event".into(),
                as_column: "app_name".into(),
            }),
            group_by: vec!["app_name".into()],
            aggregates: vec![Aggregate::parse("app_count", "count").unwrap()],
        }
    }

    #[test]
    fn json_paths_parse_and_select() {
        let path = JsonPath::parse("$.apps[*].name").unwrap();
        let doc: Value =
            serde_json::from_str(r#"{"apps":[{"name":"a"},{"name":"b"},{"x":1},{"name":null},{"name":7}]}"#).unwrap();
        assert_eq!(path.select(&doc).unwrap(), vec!["a", "b", "7"]);
        let missing: Value = serde_json::from_str(r#"{"other":1}"#).unwrap();
        assert!(path.select(&missing).unwrap().is_empty());
        let not_array: Value = serde_json::from_str(r#"{"apps":{"name":"a"}}"#).unwrap();
        assert_eq!(
            path.select(&not_array).unwrap_err(),
            "$.apps: expected an array, found an object"
        );
        assert_eq!(
            JsonPath::parse("$['a b'][0]")
                .unwrap()
                .select(&serde_json::json!({"a b": ["x"]}))
                .unwrap(),
            vec!["x"]
        );
        assert!(JsonPath::parse("apps").is_err());
        assert!(JsonPath::parse("$.a[").is_err());
    }

    #[test]
    fn rows_explode_into_deltas_or_fail_whole() {
        let transform = RowTransform::new(&spec(), &columns()).unwrap();
        let good = b"1\t5\t{\"apps\":[{\"name\":\"WhatsApp\"},{\"name\":\"Tik\\\\tTok\"}]}\t1";
        let keys = transform.elements(good).unwrap();
        assert_eq!(keys, vec![vec![Some("WhatsApp".into())], vec![Some("Tik\tTok".into())]]);
        let bad = transform.elements(b"2\t5\t{\"apps\":[\t2").unwrap_err();
        assert_eq!(bad.class, "malformed_json");
        let wrong = transform
            .elements(b"3\t5\t{\"apps\":[{\"name\":\"a\"},{\"name\":[1]}]}\t3")
            .unwrap_err();
        assert_eq!(wrong.class, "transform_error");
        assert!(transform.elements(b"4\t5\t\\N\t4").unwrap().is_empty());
        let mut deltas = Deltas::default();
        deltas.add(keys.clone());
        deltas.add(keys);
        let text = String::from_utf8(deltas.to_copy_text()).unwrap();
        let mut lines: Vec<&str> = text.lines().collect();
        lines.sort();
        assert_eq!(lines, vec!["Tik\\tTok\t2", "WhatsApp\t2"]);
    }

    #[test]
    fn aggregates_parse() {
        assert_eq!(
            Aggregate::parse("n", "count").unwrap().function,
            AggregateFunction::Count
        );
        let sum = Aggregate::parse("total", "sum(amount)").unwrap();
        assert_eq!(
            (sum.function, sum.column.as_deref()),
            (AggregateFunction::Sum, Some("amount"))
        );
        assert!(Aggregate::parse("x", "avg(amount)").is_err());
        assert!(Aggregate::parse("x", "sum()").is_err());
    }
}
