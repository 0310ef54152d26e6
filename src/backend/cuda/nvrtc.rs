//! NVRTC: finding the library and the CUDA headers, compiling `cuda/` to cubins for one
//! architecture, reading ptxas's resource report, and caching the cubins on disk.
//!
//! Verified without a GPU: compiling every source for sm_80 and sm_90 with NVRTC 13 from PyPI
//! (`tests/nvrtc_compile.rs`). On an H200 with NVRTC 13.0.88 (docs/gpu-results.md), compiling at
//! run time, loading the cubins ([`super::device`]) and the on-disk cache all worked, once
//! `cuda/sample.cuh` stopped requiring `__builtin_offsetof`, which 13.0 lacks (`KILN_OFFSET_IS`).
//! Only sm_90 has run; sm_80 is compiled only.
//!
//! cudarc panics when a library is missing, so every entry point checks
//! `cudarc::nvrtc::sys::is_culib_present()` first; a library under `KILN_NVRTC_DIR` is opened by
//! absolute path (RTLD_NOW | RTLD_GLOBAL) and kept loaded, so cudarc's dlopen by soname finds it.

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::kernels::CudaSource;

/// Resource use of one kernel as ptxas reports it (`--ptxas-options=-v`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    pub name: String,
    pub registers: u32,
    pub shared_bytes: u32,
    pub stack_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// One source compiled for one architecture.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub file: &'static str,
    pub arch: u32,
    pub cubin: Vec<u8>,
    /// NVRTC's log (ptxas's report included).
    pub log: String,
    pub kernels: Vec<KernelResources>,
}

#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    #[error("NVRTC not found (set KILN_NVRTC_DIR to a `pip install --target` dir of nvidia-cuda-nvrtc, or install the CUDA toolkit): {0}")]
    Missing(String),
    #[error("CUDA headers (cuda_bf16.h) not found; set CUDA_HOME or KILN_NVRTC_DIR")]
    NoHeaders,
    #[error("NVRTC failed on cuda/{file} for sm_{arch}: {what}\n{log}")]
    Compile {
        file: String,
        arch: u32,
        what: String,
        log: String,
    },
}

/// Directories a `pip install --target` of the NVIDIA wheels, or a toolkit, may live in.
fn roots() -> Vec<PathBuf> {
    let mut r = Vec::new();
    if let Some(d) = std::env::var_os("KILN_NVRTC_DIR") {
        r.push(PathBuf::from(d));
    }
    // Python site-packages that may hold the wheels.
    let mut sites = vec![PathBuf::from("/usr/lib/python3/dist-packages")];
    if let Some(home) = std::env::var_os("HOME") {
        sites.push(PathBuf::from(home).join(".local/lib"));
    }
    sites.push(PathBuf::from("/usr/local/lib"));
    for base in sites {
        if base.ends_with("dist-packages") {
            r.push(base);
            continue;
        }
        if let Ok(rd) = std::fs::read_dir(&base) {
            for e in rd.flatten() {
                let name = e.file_name();
                if name.to_string_lossy().starts_with("python3") {
                    r.push(e.path().join("site-packages"));
                    r.push(e.path().join("dist-packages"));
                }
            }
        }
    }
    r
}

fn toolkits() -> Vec<PathBuf> {
    let mut t = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = std::env::var_os(var) {
            t.push(PathBuf::from(d));
        }
    }
    t.push(PathBuf::from("/usr/local/cuda"));
    t
}

/// The directory holding `cuda_bf16.h`.
pub fn find_include_dir() -> Option<PathBuf> {
    let mut cands = Vec::new();
    for r in roots() {
        cands.push(r.join("nvidia/cu13/include"));
        cands.push(r.join("nvidia/cuda_runtime/include"));
    }
    for t in toolkits() {
        cands.push(t.join("include"));
    }
    cands.push(PathBuf::from("/usr/include"));
    cands.into_iter().find(|d| d.join("cuda_bf16.h").is_file())
}

/// An NVRTC shared library found by path (preferred over the loader's search).
fn find_library() -> Option<PathBuf> {
    let mut cands = Vec::new();
    for r in roots() {
        cands.push(r.join("nvidia/cu13/lib/libnvrtc.so.13"));
        cands.push(r.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12"));
    }
    for t in toolkits() {
        cands.push(t.join("lib64/libnvrtc.so"));
    }
    cands.into_iter().find(|p| p.is_file())
}

/// Makes NVRTC loadable and says whether it is. Never panics.
pub fn ensure_loaded() -> Result<(), NvrtcError> {
    static STATE: OnceLock<Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            if let Some(path) = find_library() {
                // SAFETY: loading a shared library runs its initialisers; libnvrtc's are benign.
                // The handle is leaked on purpose: cudarc resolves symbols from it for the
                // rest of the process.
                let lib = unsafe {
                    libloading::os::unix::Library::open(
                        Some(&path),
                        libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                    )
                };
                match lib {
                    Ok(lib) => std::mem::forget(lib),
                    Err(e) => return Err(format!("{}: {e}", path.display())),
                }
            }
            // SAFETY: only probes dlopen with cudarc's candidate names.
            if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                Ok(())
            } else {
                Err("libnvrtc.so.13 / libnvrtc.so.12 not loadable".into())
            }
        })
        .clone()
        .map_err(NvrtcError::Missing)
}

/// NVRTC's version, `(major, minor)`.
pub fn version() -> Result<(i32, i32), NvrtcError> {
    ensure_loaded()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loaded (checked above); the pointers are valid.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(NvrtcError::Missing(format!("nvrtcVersion: {r:?}")));
    }
    Ok((major, minor))
}

/// The options every source is compiled with.
pub fn options(arch: u32, include: &Path) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--ptxas-options=-v".into(),
        "-default-device".into(),
        "-std=c++17".into(),
        format!("--include-path={}", include.display()),
    ]
}

fn c_text(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles one source to a cubin for `sm_{arch}`. Warnings are errors.
pub fn compile(src: &CudaSource, arch: u32, include: &Path) -> Result<Compiled, NvrtcError> {
    let (cubin, log) = compile_text(src.file, &src.expanded(), arch, include)?;
    let kernels = parse_ptxas(&log);
    Ok(Compiled {
        file: src.file,
        arch,
        cubin,
        log,
        kernels,
    })
}

/// Compiles `text` (named `file` in errors) to a cubin for `sm_{arch}`; returns it and NVRTC's
/// log. Warnings are errors.
pub fn compile_text(
    file: &str,
    text: &str,
    arch: u32,
    include: &Path,
) -> Result<(Vec<u8>, String), NvrtcError> {
    use cudarc::nvrtc::{result, sys};
    ensure_loaded()?;
    let fail = |what: String, log: String| NvrtcError::Compile {
        file: file.to_string(),
        arch,
        what,
        log,
    };
    let text = CString::new(text).map_err(|e| fail(e.to_string(), String::new()))?;
    let name = CString::new(file).map_err(|e| fail(e.to_string(), String::new()))?;
    let prog = result::create_program(text.as_c_str(), Some(name.as_c_str()))
        .map_err(|e| fail(format!("create program: {e:?}"), String::new()))?;
    let opts = options(arch, include);
    // SAFETY: `prog` is a live program from create_program, destroyed exactly once below.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(prog) }
        .map(|l| c_text(&l))
        .unwrap_or_default();
    let cubin = compiled.map_err(|e| format!("{e:?}")).and_then(|()| {
        let mut size = 0usize;
        // SAFETY: as above; the buffer is `size` bytes long.
        unsafe {
            let r = sys::nvrtcGetCUBINSize(prog, &mut size);
            if r != sys::nvrtcResult::NVRTC_SUCCESS {
                return Err(format!("nvrtcGetCUBINSize: {r:?}"));
            }
            let mut buf = vec![0u8; size];
            let r = sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char);
            if r != sys::nvrtcResult::NVRTC_SUCCESS {
                return Err(format!("nvrtcGetCUBIN: {r:?}"));
            }
            Ok(buf)
        }
    });
    // SAFETY: destroyed once; nothing uses `prog` after this.
    let _ = unsafe { result::destroy_program(prog) };
    let cubin = cubin.map_err(|what| fail(what, log.clone()))?;
    if let Some(w) = log.lines().find(|l| {
        let l = l.to_ascii_lowercase();
        l.contains("warning") || l.contains("error")
    }) {
        return Err(fail(format!("warning treated as error: {w}"), log));
    }
    Ok((cubin, log))
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].split_whitespace().last()?.parse().ok()
}

/// Parses ptxas's `-v` report: per function, registers, shared memory, stack and spills.
pub fn parse_ptxas(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(at) = line.find("Function properties for ") {
            let name = line[at + "Function properties for ".len()..]
                .trim()
                .to_string();
            out.push(KernelResources {
                name,
                ..Default::default()
            });
        } else if let Some(k) = out.last_mut() {
            if line.contains("bytes stack frame") {
                k.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                k.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                k.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used") && line.contains("registers") {
                k.registers = number_before(line, "registers").unwrap_or(0);
                k.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// FNV-1a, 64 bits: a hash that stays the same across Rust versions (for cache keys).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// `$XDG_CACHE_HOME/kiln` or `~/.cache/kiln`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("kiln"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kiln"))
}

/// A cubin for `src` on `sm_{arch}`, from the on-disk cache when the source hash, architecture
/// and NVRTC version match, else compiled (and stored; a cache that cannot be written is
/// ignored).
pub fn compile_cached(src: &CudaSource, arch: u32, include: &Path) -> Result<Vec<u8>, NvrtcError> {
    compile_text_cached(src.file, &src.expanded(), arch, include)
}

/// Where [`compile_text_cached`] keeps the cubin of `text` (compiled as `file`) for `sm_{arch}`
/// under the loaded NVRTC's version; `None` without a cache directory.
pub fn cache_path(file: &str, text: &str, arch: u32) -> Result<Option<PathBuf>, NvrtcError> {
    let (major, minor) = version()?;
    let key = format!(
        "{}-sm{arch}-nvrtc{major}.{minor}-{:016x}.cubin",
        file.trim_end_matches(".cu"),
        fnv1a(text.as_bytes())
    );
    Ok(cache_dir().map(|d| d.join(key)))
}

/// [`compile_cached`] for a source that is not one of `cuda/`'s files (the generated decode
/// megakernel): cached under `file`'s stem and the hash of `text`.
pub fn compile_text_cached(
    file: &str,
    text: &str,
    arch: u32,
    include: &Path,
) -> Result<Vec<u8>, NvrtcError> {
    let path = cache_path(file, text, arch)?;
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let (cubin, _log) = compile_text(file, text, arch, include)?;
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_ptxas_report() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'gemv_bf16' for 'sm_90'\n\
ptxas info    : Function properties for gemv_bf16\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 40 registers, used 0 barriers, 2048 bytes smem, 424 bytes cmem[0]\n";
        let k = parse_ptxas(log);
        assert_eq!(
            k,
            vec![KernelResources {
                name: "gemv_bf16".into(),
                registers: 40,
                shared_bytes: 2048,
                stack_bytes: 8,
                spill_stores: 4,
                spill_loads: 12,
            }]
        );
        assert_ne!(fnv1a(b"a"), fnv1a(b"b"));
    }
}
