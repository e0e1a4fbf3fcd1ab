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
}

impl MariaDb {
    pub async fn create(tag: &str) -> MariaDb {
        let name = unique_name(tag);
        let admin = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&server_url())
            .await
            .expect("MariaDB at TIDEMARK_TEST_MARIADB (default 127.0.0.1:3306) must be running");
        admin
            .execute(sqlx::AssertSqlSafe(format!(
                "CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci"
            )))
            .await
            .unwrap();
        admin.close().await;
        let url = format!("{}/{name}", server_url());
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
        MariaDb { name, url, pool }
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
        let sessions = mysql_cli_output(&format!(
            "SELECT id FROM information_schema.processlist WHERE db = '{}' AND id <> CONNECTION_ID()",
            self.name
        ));
        for id in sessions.split_whitespace() {
            let _ = mysql_cli(&format!("KILL {id}"));
        }
        let _ = mysql_cli(&format!(
            "SET SESSION lock_wait_timeout = 10; DROP DATABASE IF EXISTS `{}`",
            self.name
        ));
    }
}

/// A login account of one test (server-wide), dropped on drop.
pub struct MariaUser {
    pub name: String,
    pub password: String,
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
        MariaUser { name, password }
    }
}

impl Drop for MariaUser {
    fn drop(&mut self) {
        let _ = mysql_cli(&format!("DROP USER IF EXISTS '{0}'@'%', '{0}'@'localhost'", self.name));
    }
}

fn mysql_command(sql: &str) -> Command {
    let url = server_url();
    let rest = url.trim_start_matches("mysql://");
    let (user, host_port) = rest.split_once('@').unwrap_or(("root", rest));
    let (host, port) = host_port.split_once(':').unwrap_or((host_port, "3306"));
    let mut command = Command::new("mariadb");
    command.args(["-N", "-B", "-h", host, "-P", port, "-u", user, "-e", sql]);
    command
}

fn mysql_cli(sql: &str) -> std::io::Result<std::process::ExitStatus> {
    mysql_command(sql).stdout(Stdio::null()).stderr(Stdio::null()).status()
}

fn mysql_cli_output(sql: &str) -> String {
    mysql_command(sql)
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}
