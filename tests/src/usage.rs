//! What processes and the machine spend, read from `/proc`: for benchmarks that print CPU time
//! beside wall time (a ratio of CPU seconds is steadier than one of seconds on a shared box).

/// CPU seconds (user + system) and resident MiB (now, peak) of a process.
pub fn process_usage(pid: u32) -> (f64, f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // After the command: state is field 0, utime 11, stime 12 (clock ticks of 1/100 s).
    let cpu = (ticks(11) + ticks(12)) / 100.0;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (cpu, kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0)
}

/// The machine's busy CPU time from `/proc/stat`, in clock ticks of 1/100 s.
pub fn box_ticks() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal: idle and iowait are not busy.
    let all: f64 = ticks.iter().take(8).sum();
    all - ticks.get(3).copied().unwrap_or(0.0) - ticks.get(4).copied().unwrap_or(0.0)
}
