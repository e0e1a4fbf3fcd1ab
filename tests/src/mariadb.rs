//! A MariaDB database (and optionally a login role) of one test on the machine's server
//! (`TIDEMARK_TEST_MARIADB`, default `mysql://root@127.0.0.1:3306`), dropped on drop.

use std::process::{Command, Stdio};

use sqlx::Executor;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

use crate::unique_name;

pub fn server_url() -> String {
    std::env::var("TIDEMARK_TEST_MARIADB").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".to_string())
}

pub struct MariaDb {
    pub name: String,
    /// `mysql://root@…/name`.
    pub url: String,
    pub pool: MySqlPool,
    /// The server's URL (`mysql://root@host:port`).
    server: String,
}

impl MariaDb {
    pub async fn create(tag: &str) -> MariaDb {
        MariaDb::create_on(&server_url(), tag).await
    }

    /// A database on another server (e.g. a [`MariaServer`] of the test's own).
    pub async fn create_on(server: &str, tag: &str) -> MariaDb {
        let name = unique_name(tag);
        let admin = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(server)
            .await
            .expect("MariaDB at TIDEMARK_TEST_MARIADB (default 127.0.0.1:3306) must be running");
        admin
            .execute(sqlx::AssertSqlSafe(format!(
                "CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci"
            )))
            .await
            .unwrap();
        admin.close().await;
        let url = format!("{server}/{name}");
        let pool = MySqlPoolOptions::new()
            .max_connections(4)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("SET SESSION time_zone = '+00:00'").await?;
                    Ok(())
                })
            })
            .connect(&url)
            .await
            .unwrap();
        MariaDb {
            name,
            url,
            pool,
            server: server.to_string(),
        }
    }

    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// This database's URL for another account.
    pub fn url_as(&self, user: &str, password: &str) -> String {
        self.url.replacen("root@", &format!("{user}:{password}@"), 1)
    }
}

impl Drop for MariaDb {
    fn drop(&mut self) {
        // The pool (and any coordinator or worker still alive) may hold metadata locks that
        // would block the DROP forever: end every session of the database first.
        let sessions = mysql_cli_output(
            &self.server,
            &format!(
                "SELECT id FROM information_schema.processlist WHERE db = '{}' AND id <> CONNECTION_ID()",
                self.name
            ),
        );
        for id in sessions.split_whitespace() {
            let _ = mysql_cli(&self.server, &format!("KILL {id}"));
        }
        let _ = mysql_cli(
            &self.server,
            &format!(
                "SET SESSION lock_wait_timeout = 10; DROP DATABASE IF EXISTS `{}`",
                self.name
            ),
        );
    }
}

/// A table of many MariaDB types, the fixture of the MariaDB source and target tests.
pub const ITEMS_TABLE: &str = "CREATE TABLE items (
    id BIGINT NOT NULL PRIMARY KEY,
    flag TINYINT(1) NOT NULL,
    amount DECIMAL(65,30) NOT NULL,
    big BIGINT UNSIGNED NOT NULL,
    happened DATETIME(6) NULL,
    note VARCHAR(100) CHARACTER SET utf8mb4 NULL,
    latin VARCHAR(50) CHARACTER SET latin1 NULL,
    raw BINARY(16) NULL,
    kind ENUM('small','large') NOT NULL,
    doc JSON NULL,
    updated_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
    KEY items_cursor (updated_at, id)
) ENGINE=InnoDB";

/// Rows `first..=last`: a 4-byte character, a tab, a quote, a backslash, latin1 text, the
/// largest unsigned values.
pub fn items_insert(first: i64, last: i64) -> String {
    format!(
        "INSERT INTO items (id, flag, amount, big, happened, note, latin, raw, kind, doc) \
         SELECT seq, seq % 2, seq / 7, 18446744073709551615 - seq, \
         IF(seq % 11 = 0, NULL, TIMESTAMP'2024-03-01 10:00:00.123456' + INTERVAL seq SECOND), \
         CONCAT('note ', seq, ' \u{1F980}', IF(seq % 7 = 0, '\ttab', ''), IF(seq % 5 = 0, ' it''s \\\\ here', '')), \
         CONCAT('caf\u{e9} ', seq), UNHEX(MD5(seq)), IF(seq % 2, 'small', 'large'), JSON_OBJECT('n', seq) \
         FROM seq_{first}_to_{last}"
    )
}

/// A MariaDB database and an account with the grants the README asks of a source: SELECT on
/// the database and PROCESS for the open-transaction bound.
pub async fn reader_source(tag: &str) -> (MariaDb, MariaUser) {
    let source = MariaDb::create(tag).await;
    let user = MariaUser::create(
        &source,
        tag,
        &[
            &format!("GRANT SELECT ON `{}`.* ", source.name),
            "GRANT PROCESS ON *.* ",
        ],
    )
    .await;
    (source, user)
}

/// A MariaDB target database and an account with the target grants the README lists.
pub async fn writer_target(tag: &str) -> (MariaDb, MariaUser) {
    let target = MariaDb::create(tag).await;
    let user = MariaUser::create(
        &target,
        tag,
        &[&format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, INDEX, ALTER, DROP ON `{}`.* ",
            target.name
        )],
    )
    .await;
    (target, user)
}

/// A login account of one test (server-wide), dropped on drop.
pub struct MariaUser {
    pub name: String,
    pub password: String,
    server: String,
}

impl MariaUser {
    /// An account with `grants` (each `GRANT … TO` is completed with the account).
    pub async fn create(db: &MariaDb, tag: &str, grants: &[&str]) -> MariaUser {
        let name = unique_name(tag).chars().take(60).collect::<String>();
        let password = "tidemark-test".to_string();
        db.exec(&format!("CREATE USER '{name}'@'%' IDENTIFIED BY '{password}'"))
            .await;
        db.exec(&format!("CREATE USER '{name}'@'localhost' IDENTIFIED BY '{password}'"))
            .await;
        for grant in grants {
            for host in ["%", "localhost"] {
                db.exec(&format!("{grant} TO '{name}'@'{host}'")).await;
            }
        }
        MariaUser {
            name,
            password,
            server: db.server.clone(),
        }
    }
}

impl Drop for MariaUser {
    fn drop(&mut self) {
        let _ = mysql_cli(
            &self.server,
            &format!("DROP USER IF EXISTS '{0}'@'%', '{0}'@'localhost'", self.name),
        );
    }
}

fn mysql_command(url: &str, sql: &str) -> Command {
    let rest = url.trim_start_matches("mysql://");
    let (user, host_port) = rest.split_once('@').unwrap_or(("root", rest));
    let (host, port) = host_port.split_once(':').unwrap_or((host_port, "3306"));
    let mut command = Command::new("mariadb");
    command.args(["-N", "-B", "-h", host, "-P", port, "-u", user, "-e", sql]);
    command
}

fn mysql_cli(server: &str, sql: &str) -> std::io::Result<std::process::ExitStatus> {
    mysql_command(server, sql)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
}

fn mysql_cli_output(server: &str, sql: &str) -> String {
    mysql_command(server, sql)
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// A MariaDB server of one test (its own data directory and loopback port), for faults the
/// machine's shared server must not suffer: [`MariaServer::restart`] kills it with SIGKILL
/// and starts it again on the same port and data (InnoDB recovers committed transactions).
pub struct MariaServer {
    /// `mysql://root@127.0.0.1:port`.
    pub url: String,
    port: u16,
    dir: std::path::PathBuf,
    child: Option<std::process::Child>,
    /// The server process's `TZ` (its system time zone); `None`: this machine's.
    zone: Option<String>,
}

impl MariaServer {
    pub async fn start(tag: &str) -> MariaServer {
        MariaServer::start_in_zone(tag, None).await
    }

    /// A server whose system time zone (`TZ`, what `@@system_time_zone` reports and what
    /// InnoDB renders `innodb_trx.trx_started` in) is `zone`.
    pub async fn start_in_zone(tag: &str, zone: Option<&str>) -> MariaServer {
        let dir = std::env::temp_dir().join(unique_name(tag));
        std::fs::create_dir_all(&dir).unwrap();
        // Its own tmpdir: at start-up mariadbd deletes every `#sql*` file in its tmpdir,
        // which in the shared /tmp are the machine server's live temporary tables (seen:
        // "Error on delete of '/tmp/#sql-temptable-….MAI'" in another test's query).
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        let installed = Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg(format!("--tmpdir={}", dir.join("tmp").display()))
            .args([
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--user=root",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("mariadb-install-db (Debian's mariadb-server)");
        assert!(installed.success(), "mariadb-install-db failed in {}", dir.display());
        let port = crate::free_port();
        let mut server = MariaServer {
            url: format!("mysql://root@127.0.0.1:{port}"),
            port,
            dir,
            child: None,
            zone: zone.map(str::to_string),
        };
        server.spawn().await;
        server
    }

    async fn spawn(&mut self) {
        let mut command = Command::new("/usr/sbin/mariadbd");
        if let Some(zone) = &self.zone {
            command.env("TZ", zone);
        }
        let child = command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.dir.join("data").display()))
            .arg(format!("--port={}", self.port))
            .arg(format!("--socket={}", self.dir.join("sock").display()))
            .arg(format!("--tmpdir={}", self.dir.join("tmp").display()))
            .arg(format!("--pid-file={}", self.dir.join("pid").display()))
            .arg(format!("--log-error={}", self.dir.join("error.log").display()))
            .args([
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--user=root",
                "--innodb-buffer-pool-size=64M",
                "--max-connections=200",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mariadbd");
        self.child = Some(child);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            if let Ok(pool) = MySqlPoolOptions::new().max_connections(1).connect(&self.url).await {
                pool.close().await;
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the private MariaDB server did not start; see {}",
                self.dir.join("error.log").display()
            );
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    /// SIGKILL, then the same server again; returns once it accepts connections.
    pub async fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.spawn().await;
    }
}

impl Drop for MariaServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
