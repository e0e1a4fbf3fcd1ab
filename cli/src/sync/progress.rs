//! `tidemark sync`'s progress: a line per task with rows, rows/s and ETA during the snapshot
//! (from the planner's estimate), then the watermark's lag. Redrawn in place on a terminal,
//! plain lines otherwise (one per task when its phase changes, and every `PLAIN_EVERY`),
//! JSON lines with `--json`.

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use tidemark_proto::v1 as pb;

const PLAIN_EVERY: Duration = Duration::from_secs(10);

pub enum Style {
    Terminal,
    Plain,
    Json,
}

pub struct Progress {
    style: Style,
    /// Per task: rows applied and when, at the previous report (for rows/s).
    previous: HashMap<String, (u64, Instant)>,
    /// Per task: the phase last printed (plain lines).
    phases: HashMap<String, String>,
    last_plain: Option<Instant>,
    drawn_lines: usize,
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn seconds(s: f64) -> String {
    if s >= 90.0 {
        format!("{}m{:02}s", (s / 60.0) as u64, (s % 60.0) as u64)
    } else {
        format!("{s:.1}s")
    }
}

impl Progress {
    pub fn new(style: Style) -> Progress {
        Progress {
            style,
            previous: HashMap::new(),
            phases: HashMap::new(),
            last_plain: None,
            drawn_lines: 0,
        }
    }

    /// One line about a task (`now_micros`: the source's clock, for the lag).
    fn line(&mut self, task: &pb::TaskStatus, now_micros: i64) -> (String, serde_json::Value) {
        let now = Instant::now();
        let rate = match self.previous.insert(task.name.clone(), (task.rows_applied, now)) {
            Some((rows, at)) if now > at && task.rows_applied >= rows => {
                Some((task.rows_applied - rows) as f64 / (now - at).as_secs_f64())
            }
            _ => None,
        };
        let lag = task.watermark_micros.map(|w| (now_micros - w).max(0) as f64 / 1e6);
        let json = serde_json::json!({
            "task": task.name,
            "phase": task.phase,
            "rows_applied": task.rows_applied,
            "estimated_rows": task.estimated_rows,
            "rows_per_second": rate.map(|r| r.round()),
            "watermark_micros": task.watermark_micros,
            "lag_seconds": lag,
            "paused_reason": (!task.paused_reason.is_empty()).then_some(&task.paused_reason),
        });
        let text = if !task.paused_reason.is_empty() {
            format!("{}  paused: {}", task.name, task.paused_reason)
        } else if !task.snapshot_complete {
            let mut text = format!("{}  snapshot  {}", task.name, thousands(task.rows_applied));
            if task.estimated_rows > 0 {
                let share = (task.rows_applied as f64 / task.estimated_rows as f64 * 100.0).min(100.0);
                text.push_str(&format!(" / ~{} rows ({share:.0}%)", thousands(task.estimated_rows)));
            } else {
                text.push_str(" rows");
            }
            if let Some(rate) = rate.filter(|r| *r > 0.0) {
                text.push_str(&format!("  {} rows/s", thousands(rate as u64)));
                if task.estimated_rows > task.rows_applied {
                    let eta = (task.estimated_rows - task.rows_applied) as f64 / rate;
                    text.push_str(&format!("  ETA {}", seconds(eta)));
                }
            }
            text
        } else {
            let lag = lag.map_or_else(|| "-".to_string(), seconds);
            format!(
                "{}  incremental  {} rows  watermark lag {lag}",
                task.name,
                thousands(task.rows_applied)
            )
        };
        (text, json)
    }

    /// Reports the tasks' state.
    pub fn report(&mut self, status: &pb::StatusResponse, now_micros: i64) {
        let lines: Vec<(String, serde_json::Value, String)> = status
            .tasks
            .iter()
            .map(|task| {
                let (text, json) = self.line(task, now_micros);
                (text, json, task.phase.clone())
            })
            .collect();
        let mut out = std::io::stdout().lock();
        match self.style {
            Style::Json => {
                for (_, json, _) in &lines {
                    let _ = writeln!(out, "{json}");
                }
            }
            Style::Terminal => {
                if self.drawn_lines > 0 {
                    let _ = write!(out, "\x1b[{}A", self.drawn_lines);
                }
                for (text, _, _) in &lines {
                    let _ = writeln!(out, "\x1b[2K{text}");
                }
                self.drawn_lines = lines.len();
            }
            Style::Plain => {
                let due = self.last_plain.is_none_or(|at| at.elapsed() >= PLAIN_EVERY);
                for ((text, _, phase), task) in lines.iter().zip(&status.tasks) {
                    let changed = self.phases.insert(task.name.clone(), phase.clone()).as_ref() != Some(phase);
                    if due || changed {
                        let _ = writeln!(out, "{text}");
                    }
                }
                if due {
                    self.last_plain = Some(Instant::now());
                }
            }
        }
        let _ = out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_in_thousands() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(seconds(3.25), "3.2s");
        assert_eq!(seconds(125.0), "2m05s");
    }
}
