//! The staging store: immutable batch objects in any `object_store` URL.
//!
//! All object paths are built here. Writes are create-if-absent: an object that already
//! exists with the same bytes is success, with other bytes an error, so a staged batch can
//! never change under a reader. The data object is written first and the manifest last; a
//! data object without a manifest is a torn write that nothing references.

use std::sync::Arc;

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::batch::{LZ4_SUFFIX, Manifest, content_hash};
use crate::crash;
use crate::redact::redact_url;

#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    #[error("staging URL {url}: {message}")]
    Url { url: String, message: String },
    #[error("staging object {path}: {source}")]
    Store { path: String, source: object_store::Error },
    #[error("staging object {path} already exists with different content")]
    Conflict { path: String },
    #[error("staged batch {batch_id} is corrupt: {message}")]
    Corrupt { batch_id: String, message: String },
    #[error(
        "the staging store ignores create-only writes ({path} was overwritten): a zombie's manifest could replace \
         the owner's; use a store that honours If-None-Match (AWS S3, MinIO, Ceph RGW, SeaweedFS, moto)"
    )]
    Unconditional { path: String },
    #[error("the staging store did not answer within {timeout:?}")]
    Unreachable { timeout: std::time::Duration },
}

impl StagingError {
    /// Whether retrying cannot help: the store refuses our credentials or permissions.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            StagingError::Store {
                source: object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. },
                ..
            } | StagingError::Unconditional { .. }
        )
    }
}

/// Options of an `s3://bucket/prefix?…` staging URL that must not travel in it: the URL
/// goes to every worker with its assignment. Credentials come from each process's
/// environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`), a web
/// identity or an instance role, which object_store reads.
const SECRET_S3_OPTIONS: [&str; 6] = [
    "access_key_id",
    "aws_access_key_id",
    "secret_access_key",
    "aws_secret_access_key",
    "session_token",
    "aws_session_token",
];

/// An S3-compatible store from `s3://bucket/prefix?endpoint=…&region=…&allow_http=true&
/// virtual_hosted_style_request=false…` (any object_store S3 option by its name), with the
/// rest of its configuration from the environment (`AWS_*`). Requests are retried with
/// backoff on throttling and 5xx responses, at most 5 times and for 60 s.
fn open_s3(url: &url::Url) -> Result<Staging, String> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
    let mut base = url.clone();
    base.set_query(None);
    let mut builder = AmazonS3Builder::from_env().with_url(base.as_str());
    for (key, value) in url.query_pairs() {
        let key = key.to_ascii_lowercase();
        if SECRET_S3_OPTIONS.contains(&key.as_str()) {
            return Err(format!(
                "{key} must not be in the staging URL (it is sent to every worker): set AWS_ACCESS_KEY_ID / \
                 AWS_SECRET_ACCESS_KEY in each process's environment, or use an instance role"
            ));
        }
        let config: AmazonS3ConfigKey = key
            .parse()
            .map_err(|_| format!("unknown S3 option {key:?} (object_store's S3 options: endpoint, region, allow_http, virtual_hosted_style_request, …)"))?;
        builder = builder.with_config(config, value.into_owned());
    }
    let retry = object_store::RetryConfig {
        max_retries: 5,
        retry_timeout: std::time::Duration::from_secs(60),
        ..Default::default()
    };
    let store = builder.with_retry(retry).build().map_err(|e| e.to_string())?;
    let prefix = Path::from_url_path(url.path()).map_err(|e| e.to_string())?;
    Ok(Staging {
        store: Arc::new(store),
        prefix,
    })
}

#[derive(Clone)]
pub struct Staging {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Staging({})", self.prefix)
    }
}

impl Staging {
    /// Opens a staging store; a `file://` directory is created when missing.
    pub fn open(url_text: &str) -> Result<Staging, StagingError> {
        let url_error = |message: String| StagingError::Url {
            url: redact_url(url_text),
            message,
        };
        let url = url::Url::parse(url_text).map_err(|e| url_error(e.to_string()))?;
        if url.scheme() == "file" {
            let dir = url.to_file_path().map_err(|_| url_error("not a local path".into()))?;
            std::fs::create_dir_all(&dir).map_err(|e| url_error(e.to_string()))?;
        }
        if matches!(url.scheme(), "s3" | "s3a") {
            return open_s3(&url).map_err(url_error);
        }
        let (store, prefix) = object_store::parse_url(&url).map_err(|e| url_error(e.to_string()))?;
        Ok(Staging {
            store: Arc::from(store),
            prefix,
        })
    }

    /// A staging store on an object store built elsewhere (a test's client with its own
    /// credentials), under `prefix`.
    pub fn from_store(store: Arc<dyn ObjectStore>, prefix: &str) -> Staging {
        Staging {
            store,
            prefix: Path::from(prefix),
        }
    }

    /// Checks that the store answers and honours create-only writes (`If-None-Match: *` on
    /// S3): a probe object is created, created again with other bytes (which must be refused),
    /// and deleted. A store that ignores the condition would let a zombie's manifest replace
    /// the owner's, so it is refused by name; an unreachable or misconfigured one fails here,
    /// within `timeout`, instead of on the first batch.
    pub async fn probe(&self, timeout: std::time::Duration) -> Result<(), StagingError> {
        let path = format!("_tidemark/probe-{}", uuid::Uuid::new_v4().simple());
        let check = async {
            self.put_if_absent(&path, Bytes::from_static(b"first")).await?;
            let again = self
                .store
                .put_opts(
                    &self.location(&path),
                    PutPayload::from(Bytes::from_static(b"second")),
                    PutOptions::from(PutMode::Create),
                )
                .await;
            let result = match again {
                Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
                Ok(_) => Err(StagingError::Unconditional { path: path.clone() }),
                Err(source) => Err(StagingError::Store {
                    path: path.clone(),
                    source,
                }),
            };
            self.delete(&path).await?;
            result
        };
        tokio::time::timeout(timeout, check)
            .await
            .map_err(|_| StagingError::Unreachable { timeout })?
    }

    fn batch_dir(&self, task: &str, epoch: u64, shard_id: u32, batch_id: &str) -> String {
        format!("{task}/epoch-{epoch}/shard-{shard_id}/{batch_id}")
    }

    /// Data objects are content-addressed inside the batch's folder, so two reads of the same
    /// bounds that saw different rows never overwrite each other.
    pub fn data_path(&self, manifest: &Manifest) -> String {
        let hash = manifest.content_hash.trim_start_matches("sha256:");
        format!(
            "{}/data-{hash}.copy.lz4",
            self.batch_dir(&manifest.task, manifest.epoch, manifest.shard_id, &manifest.batch_id)
        )
    }

    /// A manifest names its writer's fence token, so each owner that stages the same bounds
    /// writes its own manifest and never collides with one left by a crashed predecessor;
    /// the batch registry records which manifest is the batch's.
    pub fn manifest_path(&self, manifest: &Manifest) -> String {
        let hash = manifest.content_hash.trim_start_matches("sha256:");
        let dir = self.batch_dir(&manifest.task, manifest.epoch, manifest.shard_id, &manifest.batch_id);
        format!("{dir}/manifest-{hash}-fence-{}.json", manifest.fence_token)
    }

    fn location(&self, relative: &str) -> Path {
        let mut location = self.prefix.clone();
        for part in relative.split('/') {
            location = location.clone().join(part);
        }
        location
    }

    async fn put_if_absent(&self, relative: &str, bytes: Bytes) -> Result<(), StagingError> {
        let location = self.location(relative);
        let options = PutOptions::from(PutMode::Create);
        match self
            .store
            .put_opts(&location, PutPayload::from(bytes.clone()), options)
            .await
        {
            Ok(_) => Ok(()),
            Err(object_store::Error::AlreadyExists { .. }) => {
                let existing = self.get(relative).await?;
                if existing == bytes {
                    Ok(())
                } else {
                    Err(StagingError::Conflict {
                        path: relative.to_string(),
                    })
                }
            }
            Err(source) => Err(StagingError::Store {
                path: relative.to_string(),
                source,
            }),
        }
    }

    pub async fn get(&self, relative: &str) -> Result<Bytes, StagingError> {
        let store_error = |source| StagingError::Store {
            path: relative.to_string(),
            source,
        };
        let result = self.store.get(&self.location(relative)).await.map_err(store_error)?;
        result.bytes().await.map_err(store_error)
    }

    /// Writes data then manifest; returns the manifest's path. `manifest.data_path` is filled
    /// in here.
    pub async fn write_batch(&self, manifest: &mut Manifest, data: Bytes) -> Result<String, StagingError> {
        debug_assert_eq!(manifest.content_hash, content_hash(&data));
        manifest.data_path = self.data_path(manifest);
        if crash::armed("mid_data") {
            // A non-atomic store torn by a crash: a prefix of the object at its final path.
            let stored = compress(&data);
            let half = stored.slice(..stored.len() / 2);
            let _ = self
                .store
                .put(&self.location(&manifest.data_path), PutPayload::from(half))
                .await;
            crash::kill("mid_data");
        }
        if !manifest.data_format.ends_with(LZ4_SUFFIX) {
            manifest.data_format.push_str(LZ4_SUFFIX);
        }
        self.put_data(&manifest.data_path, &manifest.content_hash, compress(&data))
            .await?;
        crash::point("after_data");
        let manifest_path = self.manifest_path(manifest);
        let manifest_bytes = serde_json::to_vec_pretty(manifest).expect("manifest serializes");
        self.put_if_absent(&manifest_path, Bytes::from(manifest_bytes)).await?;
        Ok(manifest_path)
    }

    /// Data objects are named by their hash, so an object already at the path whose bytes do
    /// not hash to its name is a torn write (nothing can reference it: no manifest names
    /// it), and is replaced.
    async fn put_data(&self, relative: &str, hash: &str, data: Bytes) -> Result<(), StagingError> {
        match self.put_if_absent(relative, data.clone()).await {
            Err(StagingError::Conflict { .. }) => {
                let existing = self.get(relative).await?;
                if decompress(relative, &existing).is_ok_and(|d| content_hash(&d) == hash) {
                    return Ok(());
                }
                tracing::warn!(path = relative, "replacing a torn staging object");
                self.store
                    .put(&self.location(relative), PutPayload::from(data))
                    .await
                    .map_err(|source| StagingError::Store {
                        path: relative.to_string(),
                        source,
                    })?;
                Ok(())
            }
            other => other,
        }
    }

    /// Reads a batch by its manifest and verifies the data against the manifest's hash and
    /// size.
    pub async fn read_batch(&self, manifest_path: &str) -> Result<(Manifest, Bytes), StagingError> {
        let manifest_bytes = self.get(manifest_path).await?;
        let manifest: Manifest = serde_json::from_slice(&manifest_bytes).map_err(|e| StagingError::Corrupt {
            batch_id: manifest_path.to_string(),
            message: format!("manifest does not parse: {e}"),
        })?;
        let stored = self.get(&manifest.data_path).await?;
        let data = if manifest.data_path.ends_with(".lz4") {
            decompress(&manifest.batch_id, &stored)?
        } else {
            stored
        };
        let actual = content_hash(&data);
        if actual != manifest.content_hash || data.len() as u64 != manifest.byte_size {
            return Err(StagingError::Corrupt {
                batch_id: manifest.batch_id.clone(),
                message: format!(
                    "data hash {actual} ({} bytes) does not match manifest {} ({} bytes)",
                    data.len(),
                    manifest.content_hash,
                    manifest.byte_size
                ),
            });
        }
        Ok((manifest, data))
    }
}

/// One staged object as the janitor sees it.
#[derive(Debug, Clone)]
pub struct StagedObject {
    /// Path relative to the staging root: `task/epoch-E/shard-S/BATCH/file`.
    pub path: String,
    pub batch_id: Option<String>,
    pub age: std::time::Duration,
}

impl Staging {
    /// Every object under the staging root, with the batch id its folder names.
    pub async fn list(&self) -> Result<Vec<StagedObject>, StagingError> {
        use futures::TryStreamExt;
        let now = chrono::Utc::now();
        let prefix = self.prefix.clone();
        let metas: Vec<object_store::ObjectMeta> =
            self.store
                .list(Some(&prefix))
                .try_collect()
                .await
                .map_err(|source| StagingError::Store {
                    path: prefix.to_string(),
                    source,
                })?;
        Ok(metas
            .into_iter()
            .map(|meta| {
                let full = meta.location.to_string();
                let relative = full
                    .strip_prefix(prefix.as_ref())
                    .unwrap_or(&full)
                    .trim_start_matches('/')
                    .to_string();
                let parts: Vec<&str> = relative.split('/').collect();
                let batch_id = (parts.len() == 5).then(|| parts[3].to_string());
                let age = (now - meta.last_modified).to_std().unwrap_or_default();
                StagedObject {
                    path: relative,
                    batch_id,
                    age,
                }
            })
            .collect())
    }

    pub async fn delete(&self, relative: &str) -> Result<(), StagingError> {
        match self.store.delete(&self.location(relative)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(source) => Err(StagingError::Store {
                path: relative.to_string(),
                source,
            }),
        }
    }
}

/// Staged data objects are LZ4 blocks with the uncompressed size in front: COPY text
/// compresses several times over, and LZ4 costs little CPU on the hot path.
fn compress(data: &[u8]) -> Bytes {
    Bytes::from(lz4_flex::block::compress_prepend_size(data))
}

fn decompress(batch_id: &str, stored: &[u8]) -> Result<Bytes, StagingError> {
    lz4_flex::block::decompress_size_prepended(stored)
        .map(Bytes::from)
        .map_err(|e| StagingError::Corrupt {
            batch_id: batch_id.to_string(),
            message: format!("data object does not decompress: {e}"),
        })
}
