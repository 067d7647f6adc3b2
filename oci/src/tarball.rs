//! The few tar rules the image needs: writing a ustar archive of one regular file with fixed
//! metadata, and reading regular files back out of any ustar/GNU/pax archive (to check a layer
//! the way a fetcher would). POSIX.1-1988 ustar header layout: name 0..100, mode 100..108,
//! uid/gid, size 124..136 (octal), mtime 136..148, checksum 148..156, typeflag 156,
//! magic 257..263, prefix 345..500.

use anyhow::{bail, Result};

const BLOCK: usize = 512;

/// A tar archive holding `name` (mode 0644, owner 0:0, mtime 0) with `data`, ended by two zero
/// blocks.
pub fn single_file(name: &str, data: &[u8]) -> Result<Vec<u8>> {
    if name.is_empty() || name.len() > 100 {
        bail!("tar entry name {name:?} must be 1 to 100 bytes");
    }
    let mut header = [0u8; BLOCK];
    put(&mut header, 0, name.as_bytes());
    put(&mut header, 100, b"0000644\0");
    put(&mut header, 108, b"0000000\0");
    put(&mut header, 116, b"0000000\0");
    put(&mut header, 124, format!("{:011o}\0", data.len()).as_bytes());
    put(&mut header, 136, b"00000000000\0");
    header[156] = b'0';
    put(&mut header, 257, b"ustar\0");
    put(&mut header, 263, b"00");
    // The checksum is computed with its own field read as spaces.
    put(&mut header, 148, b"        ");
    let sum: u32 = header.iter().map(|&b| u32::from(b)).sum();
    put(&mut header, 148, format!("{sum:06o}\0 ").as_bytes());

    let padded = data.len().div_ceil(BLOCK) * BLOCK;
    let mut out = Vec::with_capacity(BLOCK + padded + 2 * BLOCK);
    out.extend_from_slice(&header);
    out.extend_from_slice(data);
    out.resize(BLOCK + padded + 2 * BLOCK, 0);
    Ok(out)
}

fn put(header: &mut [u8; BLOCK], at: usize, bytes: &[u8]) {
    if let Some(dst) = header.get_mut(at..at + bytes.len()) {
        dst.copy_from_slice(bytes);
    }
}

/// A regular file found in an archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The path as stored (ustar prefix joined, a leading `./` removed).
    pub name: String,
    pub data: Vec<u8>,
}

/// Every regular file in `tar`, in order. Other entry kinds (directories, links, pax and GNU
/// long-name records) are skipped; a header whose checksum does not add up, or a size that runs
/// past the end, is an error.
pub fn regular_files(tar: &[u8]) -> Result<Vec<Entry>> {
    let mut files = Vec::new();
    let mut at = 0;
    while let Some(header) = tar.get(at..at + BLOCK) {
        if header.iter().all(|&b| b == 0) {
            break;
        }
        let stored_sum = octal(header.get(148..156).unwrap_or_default())?;
        let sum: u64 = header.iter().enumerate().map(|(i, &b)| if (148..156).contains(&i) { u64::from(b' ') } else { u64::from(b) }).sum();
        if stored_sum != sum {
            bail!("tar header at byte {at}: checksum {stored_sum} but the header adds up to {sum}");
        }
        let size = usize::try_from(octal(header.get(124..136).unwrap_or_default())?)?;
        let data_start = at + BLOCK;
        let Some(data) = tar.get(data_start..data_start + size) else {
            bail!("tar entry at byte {at} claims {size} bytes past the end of the archive");
        };
        let typeflag = header.get(156).copied().unwrap_or(0);
        if typeflag == b'0' || typeflag == 0 {
            let field = |range: std::ops::Range<usize>| {
                let raw = header.get(range).unwrap_or_default();
                let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
                String::from_utf8_lossy(raw.get(..end).unwrap_or_default()).into_owned()
            };
            let (name, prefix) = (field(0..100), if header.get(257..262) == Some(b"ustar") { field(345..500) } else { String::new() });
            let full = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
            files.push(Entry { name: full.trim_start_matches("./").to_string(), data: data.to_vec() });
        }
        at = data_start + size.div_ceil(BLOCK) * BLOCK;
    }
    Ok(files)
}

/// A NUL- or space-terminated octal field.
fn octal(field: &[u8]) -> Result<u64> {
    let digits: Vec<u8> = field.iter().copied().skip_while(|&b| b == b' ').take_while(|&b| (b'0'..=b'7').contains(&b)).collect();
    if digits.is_empty() {
        return Ok(0);
    }
    let text = std::str::from_utf8(&digits)?;
    Ok(u64::from_str_radix(text, 8)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_file_reads_back_and_the_checksum_is_checked() {
        let data: Vec<u8> = (0..1300u32).map(|i| (i % 251) as u8).collect();
        let tar = single_file("plugin.wasm", &data).unwrap();
        assert_eq!(tar.len(), 512 + 1536 + 1024);
        assert_eq!(regular_files(&tar).unwrap(), vec![Entry { name: "plugin.wasm".into(), data: data.clone() }]);
        let mut broken = tar.clone();
        broken[0] = b'q';
        assert!(regular_files(&broken).unwrap_err().to_string().contains("checksum"));
        let truncated = &tar[..700];
        assert!(regular_files(truncated).unwrap_err().to_string().contains("past the end"));
    }

    #[test]
    fn the_archive_does_not_depend_on_when_or_by_whom_it_is_made() {
        assert_eq!(single_file("plugin.wasm", b"\0asm").unwrap(), single_file("plugin.wasm", b"\0asm").unwrap());
        assert!(single_file("", b"x").is_err());
        assert!(single_file(&"n".repeat(101), b"x").is_err());
    }
}
