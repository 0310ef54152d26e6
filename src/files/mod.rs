//! Opening the files a model names without trusting what they are. A FIFO blocks `open` forever,
//! a character device has no size and cannot be mapped, and `/dev/zero` reads forever, so every
//! file is checked to be a regular file before it is opened (and again after), and whole-file
//! reads are capped at a size fitting what they hold.
//!
//! The lowest layer of loading: [`LoadError`], this opening, and the GGUF container ([`gguf`]) serve
//! both the model loader and the tokenizer, and import neither.

use std::fs::{File, Metadata};
use std::io::Read;
use std::path::Path;

mod error;
pub mod gguf;

pub use error::{escape, Escaped, EscapedPath, LoadError};

/// Cap on a JSON side file (`config.json`, `generation_config.json`, `tokenizer_config.json`,
/// a shard index, a chat template): real ones are kilobytes.
pub(crate) const MAX_SIDE_FILE: u64 = 64 << 20;

/// Cap on `tokenizer.json`: the largest real vocabularies write tens of megabytes.
pub(crate) const MAX_TOKENIZER_JSON: u64 = 512 << 20;

/// What a path is, in words, for an error that refuses it.
fn kind_of(meta: &Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// The path's metadata (symlinks followed), refusing anything that is neither a regular file
/// nor a directory.
pub(crate) fn file_or_dir(path: &Path) -> Result<Metadata, LoadError> {
    let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
    if meta.is_file() || meta.is_dir() {
        Ok(meta)
    } else {
        Err(refused(path, &meta, "a model file or directory"))
    }
}

fn refused(path: &Path, meta: &Metadata, wanted: &str) -> LoadError {
    LoadError::format(
        path,
        format!(
            "is {}, not {wanted}; kiln reads regular files only",
            kind_of(meta)
        ),
    )
}

/// Opens a regular file for reading; anything else is refused before `open` can block on it.
pub(crate) fn open_regular(path: &Path) -> Result<File, LoadError> {
    let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
    if !meta.is_file() {
        return Err(refused(path, &meta, "a regular file"));
    }
    let file = File::open(path).map_err(|e| LoadError::io(path, e))?;
    // The path may have been swapped between the check and the open.
    let meta = file.metadata().map_err(|e| LoadError::io(path, e))?;
    if !meta.is_file() {
        return Err(refused(path, &meta, "a regular file"));
    }
    Ok(file)
}

/// The whole of a regular file of at most `max` bytes.
pub(crate) fn read_capped(path: &Path, max: u64) -> Result<Vec<u8>, LoadError> {
    let file = open_regular(path)?;
    let len = file.metadata().map_err(|e| LoadError::io(path, e))?.len();
    if len > max {
        return Err(LoadError::format(
            path,
            format!("is {len} bytes, more than the {max} such a file can sensibly hold"),
        ));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // `take` bounds the read even if the file grows underneath.
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| LoadError::io(path, e))?;
    if bytes.len() as u64 > max {
        return Err(LoadError::format(
            path,
            format!("grew past {max} bytes while being read"),
        ));
    }
    Ok(bytes)
}

/// Whether `path` names something (a file, or anything else the caller will then refuse).
pub(crate) fn present(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_refused_by_kind() {
        let e = read_capped(Path::new("/dev/null"), 10)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/dev/null") && e.contains("character device"),
            "{e}"
        );
        assert!(!e.contains("No such device"), "{e}");
        let e = file_or_dir(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(
            e.contains("character device") && e.contains("regular"),
            "{e}"
        );
    }

    #[test]
    fn oversized_files_are_refused() {
        let p = std::env::temp_dir().join(format!("kiln-files-{}", std::process::id()));
        std::fs::write(&p, [b'x'; 100]).unwrap();
        let e = read_capped(&p, 99).unwrap_err().to_string();
        assert!(e.contains("100 bytes") && e.contains("99"), "{e}");
        assert_eq!(read_capped(&p, 100).unwrap().len(), 100);
        std::fs::remove_file(&p).unwrap();
    }
}
