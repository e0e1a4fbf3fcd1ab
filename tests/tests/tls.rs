//! gRPC over mutual TLS between workers, the CLI and the coordinator, and the coordinator's
//! etcd connection over mutual TLS. Certificates are made by the `openssl` command for this
//! test: a CA, a server certificate for 127.0.0.1, a client certificate, and a stranger's CA
//! and client certificate.
//! Boundary: everything committed before the watermark; delete policy: none.

use std::path::{Path, PathBuf};
use std::process::Command;

use tidemark_tests::{Cluster, Etcd, EtcdTls, KeyKind, TaskSettings, TempDir, binary, create_items};

/// Runs `openssl` in `dir` with whitespace-separated `args` (file names without spaces).
fn openssl(dir: &Path, args: &str) {
    let output = Command::new("openssl")
        .args(args.split_whitespace())
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "openssl {args}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `openssl req` with a new P-256 key in `{name}.key` and subject `/CN={name}`, writing
/// `out`, with `extra` arguments.
fn request(dir: &Path, name: &str, out: &str, extra: &str) {
    openssl(
        dir,
        &format!(
            "req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout {name}.key -out {out} \
             -subj /CN={name} {extra}"
        ),
    );
}

/// A CA (`{name}.pem`, `{name}.key`).
fn ca(dir: &Path, name: &str) {
    let extensions = "-x509 -days 2 -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign";
    request(dir, name, &format!("{name}.pem"), extensions);
}

/// A certificate `{name}.pem` (key `{name}.key`) that `ca` signs, with `extensions`.
fn leaf(dir: &Path, name: &str, ca: &str, extensions: &str) {
    std::fs::write(dir.join(format!("{name}.ext")), extensions).unwrap();
    request(dir, name, &format!("{name}.csr"), "");
    openssl(
        dir,
        &format!(
            "x509 -req -in {name}.csr -CA {ca}.pem -CAkey {ca}.key -CAcreateserial -out {name}.pem -days 2 \
             -extfile {name}.ext"
        ),
    );
}

struct Certs {
    dir: TempDir,
}

impl Certs {
    fn generate() -> Certs {
        let dir = TempDir::new("tls-certs");
        ca(&dir.0, "ca");
        leaf(
            &dir.0,
            "server",
            "ca",
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1\n",
        );
        let client = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n";
        leaf(&dir.0, "client", "ca", client);
        ca(&dir.0, "stranger-ca");
        leaf(&dir.0, "stranger", "stranger-ca", client);
        Certs { dir }
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.0.join(file)
    }

    /// `TIDEMARK_TLS_*` for a client trusting `ca` and presenting `cert` (if any).
    fn client_env(&self, ca: &str, cert: Option<&str>) -> Vec<(String, String)> {
        let mut env = vec![(
            "TIDEMARK_TLS_CA".to_string(),
            self.path(&format!("{ca}.pem")).display().to_string(),
        )];
        if let Some(cert) = cert {
            env.push((
                "TIDEMARK_TLS_CERT".into(),
                self.path(&format!("{cert}.pem")).display().to_string(),
            ));
            env.push((
                "TIDEMARK_TLS_KEY".into(),
                self.path(&format!("{cert}.key")).display().to_string(),
            ));
        }
        env
    }
}

/// `status` from a CLI process with exactly `env` as its TLS settings.
fn status_with(address: &str, env: &[(String, String)]) -> (bool, String) {
    let output = Command::new(binary("tidemark-coordinator"))
        .args(["status", "--json", "--coordinator", address])
        .env_remove("TIDEMARK_TLS_CA")
        .env_remove("TIDEMARK_TLS_CERT")
        .env_remove("TIDEMARK_TLS_KEY")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    (
        output.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    )
}

/// With `tls = { cert, key, client_ca }` the coordinator serves only mutual TLS. A worker and
/// the CLI holding a certificate the CA signed sync and converge per key over it. Refused: a
/// client without a certificate, one whose certificate another CA signed, a client that does
/// not trust the coordinator's CA, and a plaintext client. etcd serves only mutual TLS too,
/// and the coordinator reaches it with `etcd_tls`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_carries_the_sync_and_refuses_strangers() {
    let certs = Certs::generate();
    let mut cluster = Cluster::new("tls").await;
    create_items(&cluster.source, KeyKind::Bigint, 5_000).await;
    cluster.etcd = Etcd::start_tls(&EtcdTls {
        cert: certs.path("server.pem"),
        key: certs.path("server.key"),
        client_ca: certs.path("ca.pem"),
    });
    assert!(cluster.etcd.endpoint.starts_with("https://"));
    cluster.https = true;
    cluster.client_env = certs.client_env("ca", Some("client"));
    cluster
        .start(&TaskSettings {
            shards: 2,
            page_size: 1000,
            coordinator_extra: format!(
                "tls = {{ cert = \"{server}.pem\", key = \"{server}.key\", client_ca = \"{ca}\" }}\n\
                 etcd_tls = {{ ca = \"{ca}\", cert = \"{client}.pem\", key = \"{client}.key\" }}",
                server = certs.path("server").display(),
                client = certs.path("client").display(),
                ca = certs.path("ca.pem").display()
            ),
            ..TaskSettings::default()
        })
        .await;
    assert!(cluster.address.starts_with("https://127.0.0.1:"), "{}", cluster.address);
    cluster.spawn_worker("tls-w", 2, &[]);
    cluster
        .write_and_converge(
            "UPDATE items SET name = 'over tls', updated_at = clock_timestamp() WHERE id % 5 = 0",
            "over mutual TLS",
        )
        .await;
    let status = cluster.cli_json(&["status"]);
    assert_eq!(status["tasks"][0]["name"], "items", "{status}");
    let leader = cluster
        .try_status()
        .await
        .expect("the harness's own client over TLS")
        .leader;
    assert_eq!(leader, cluster.address, "the leader advertises its https address");

    let plaintext = cluster.address.replacen("https://", "http://", 1);
    type Refused<'a> = (&'a str, &'a str, Vec<(String, String)>);
    let refused: [Refused; 4] = [
        (
            "no client certificate",
            cluster.address.as_str(),
            certs.client_env("ca", None),
        ),
        (
            "a certificate another CA signed",
            cluster.address.as_str(),
            certs.client_env("ca", Some("stranger")),
        ),
        (
            "a client that does not trust the coordinator's CA",
            cluster.address.as_str(),
            certs.client_env("stranger-ca", Some("client")),
        ),
        ("plaintext", plaintext.as_str(), Vec::new()),
    ];
    for (what, address, env) in refused {
        let (ok, output) = status_with(address, &env);
        assert!(!ok, "{what}: status answered\n{output}");
        eprintln!("{what}: {}", output.trim());
        assert!(output.contains("coordinator"), "{what}: {output}");
    }
    let (ok, output) = status_with(&cluster.address, &[]);
    assert!(
        !ok && output.contains("set TIDEMARK_TLS_CA"),
        "https without a CA: {output}"
    );
    cluster.items_diff().await.assert_clean("after the refused clients");
}
