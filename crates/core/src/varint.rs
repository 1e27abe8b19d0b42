//! QUIC variable-length integers (RFC 9000 section 16), which HTTP/3's framing and CONNECT-IP's
//! capsules and datagrams use for every field: the two high bits of the first byte give the
//! length (1, 2, 4 or 8 bytes), the rest is the value, big-endian.

/// The largest value a varint holds (2^62 - 1).
pub const MAX: u64 = (1 << 62) - 1;

/// The value at the start of `buf` and the bytes it took; `None` when `buf` is shorter than the
/// length its first byte announces (or empty).
pub fn read(buf: &[u8]) -> Option<(u64, usize)> {
    let first = *buf.first()?;
    let len = 1usize << (first >> 6);
    let bytes = buf.get(..len)?;
    let mut v = u64::from(first & 0x3f);
    for b in &bytes[1..] {
        v = (v << 8) | u64::from(*b);
    }
    Some((v, len))
}

/// Bytes `v` takes written (values above `MAX` are not representable: callers keep below it).
pub fn len(v: u64) -> usize {
    match v {
        0..=63 => 1,
        64..=16_383 => 2,
        16_384..=1_073_741_823 => 4,
        _ => 8,
    }
}

/// Append `v` (at most `MAX`) to `out` in its shortest form.
pub fn write(v: u64, out: &mut Vec<u8>) {
    debug_assert!(v <= MAX);
    let n = len(v);
    let tag = (n.trailing_zeros() as u64) << (8 * n - 2);
    out.extend_from_slice(&(v | tag).to_be_bytes()[8 - n..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 9000 appendix A.1's examples, and every length's bounds.
    #[test]
    fn reads_and_writes_the_rfc_examples() {
        let cases: [(&[u8], u64); 4] = [
            (
                &[0xc2, 0x19, 0x7c, 0x5e, 0xff, 0x14, 0xe8, 0x8c],
                151_288_809_941_952_652,
            ),
            (&[0x9d, 0x7f, 0x3e, 0x7d], 494_878_333),
            (&[0x7b, 0xbd], 15_293),
            (&[0x25], 37),
        ];
        for (bytes, v) in cases {
            assert_eq!(read(bytes), Some((v, bytes.len())));
            let mut out = Vec::new();
            write(v, &mut out);
            assert_eq!(out, bytes);
        }
        // A two-byte encoding of 37 is legal on the wire (not the shortest).
        assert_eq!(read(&[0x40, 0x25]), Some((37, 2)));
        for v in [0, 63, 64, 16_383, 16_384, 1_073_741_823, 1_073_741_824, MAX] {
            let mut out = Vec::new();
            write(v, &mut out);
            assert_eq!(out.len(), len(v));
            assert_eq!(read(&out), Some((v, out.len())));
            assert_eq!(read(&out[..out.len() - 1]), None);
        }
        assert_eq!(read(&[]), None);
    }
}
