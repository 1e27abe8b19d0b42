//! QPACK field sections (RFC 9204) with no dynamic table: this end announces a table capacity of
//! 0, so a peer may only use the static table and literals (a section that refers to a dynamic
//! table is an error, QPACK_DECOMPRESSION_FAILED), and its encoder and decoder streams carry
//! nothing this end needs. Literals may be Huffman-coded (RFC 7541 appendix B: quic-go's encoder
//! codes every one); this end writes its own uncoded.

use std::sync::OnceLock;

use super::tables::{HUFFMAN, STATIC};

/// One field (name, value) of a header section, as bytes (a value need not be UTF-8).
pub type Field = (Vec<u8>, Vec<u8>);

/// Why a field section could not be read (QPACK_DECOMPRESSION_FAILED, or H3_EXCESSIVE_LOAD for
/// `TooLarge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpackError {
    Malformed(&'static str),
    /// The fields decode to more than the section size this end takes.
    TooLarge,
}

impl std::fmt::Display for QpackError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QpackError::Malformed(why) => f.write_str(why),
            QpackError::TooLarge => f.write_str("field section larger than this end takes"),
        }
    }
}

/// The fields of an encoded section, at most `max_size` bytes of them counted as RFC 9114
/// section 4.2.2 counts (each name and value plus 32).
pub fn decode(mut buf: &[u8], max_size: usize) -> Result<Vec<Field>, QpackError> {
    let bad = QpackError::Malformed;
    // The prefix: Required Insert Count 0 (no dynamic table), then a Base this end ignores.
    let (ric, n) = int(buf, 8)?;
    if ric != 0 {
        return Err(bad("field section refers to a dynamic table (capacity 0)"));
    }
    buf = &buf[n..];
    let (_, n) = int(buf, 7)?;
    buf = &buf[n..];
    let mut fields = Vec::new();
    let mut size = 0usize;
    while let Some(&first) = buf.first() {
        let field = if first & 0x80 != 0 {
            // Indexed field line; T (0x40) must be the static table.
            if first & 0x40 == 0 {
                return Err(bad("indexed field line into the dynamic table"));
            }
            let (i, n) = int(buf, 6)?;
            buf = &buf[n..];
            let (name, value) = static_entry(i)?;
            (name.as_bytes().to_vec(), value.as_bytes().to_vec())
        } else if first & 0x40 != 0 {
            // Literal with name reference (N 0x20, T 0x10).
            if first & 0x10 == 0 {
                return Err(bad("literal with a name from the dynamic table"));
            }
            let (i, n) = int(buf, 4)?;
            buf = &buf[n..];
            let name = static_entry(i)?.0.as_bytes().to_vec();
            let (value, n) = string(buf, 7)?;
            buf = &buf[n..];
            (name, value)
        } else if first & 0x20 != 0 {
            // Literal with literal name (N 0x10, H 0x08, 3-bit length).
            let (name, n) = string(buf, 3)?;
            buf = &buf[n..];
            let (value, n) = string(buf, 7)?;
            buf = &buf[n..];
            (name, value)
        } else {
            return Err(bad("post-base reference into the dynamic table"));
        };
        size += field.0.len() + field.1.len() + 32;
        if size > max_size {
            return Err(QpackError::TooLarge);
        }
        fields.push(field);
    }
    Ok(fields)
}

/// An encoded section of `fields`: a static entry where one matches, the rest as literals.
pub fn encode<'a>(fields: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<u8> {
    // Required Insert Count 0, Base 0.
    let mut out = vec![0, 0];
    for (name, value) in fields {
        let by_name = STATIC.iter().position(|(n, _)| *n == name);
        match STATIC.iter().position(|e| *e == (name, value)) {
            Some(i) => put_int(&mut out, 0xc0, 6, i as u64),
            None => {
                match by_name {
                    Some(i) => put_int(&mut out, 0x50, 4, i as u64),
                    None => {
                        put_int(&mut out, 0x20, 3, name.len() as u64);
                        out.extend_from_slice(name.as_bytes());
                    }
                }
                put_int(&mut out, 0x00, 7, value.len() as u64);
                out.extend_from_slice(value.as_bytes());
            }
        }
    }
    out
}

fn static_entry(i: u64) -> Result<(&'static str, &'static str), QpackError> {
    usize::try_from(i)
        .ok()
        .and_then(|i| STATIC.get(i))
        .copied()
        .ok_or(QpackError::Malformed("static table index out of range"))
}

/// An integer with an `n`-bit prefix (RFC 7541 section 5.1) and the bytes it took.
fn int(buf: &[u8], n: u32) -> Result<(u64, usize), QpackError> {
    let short = QpackError::Malformed("field section cut short");
    let max = (1u64 << n) - 1;
    let mut v = u64::from(*buf.first().ok_or(short)?) & max;
    if v < max {
        return Ok((v, 1));
    }
    let mut shift = 0;
    for (i, b) in buf.iter().enumerate().skip(1) {
        if shift > 56 {
            return Err(QpackError::Malformed("integer too large"));
        }
        v += u64::from(b & 0x7f) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            return Ok((v, i + 1));
        }
    }
    Err(short)
}

fn put_int(out: &mut Vec<u8>, flags: u8, n: u32, v: u64) {
    let max = (1u64 << n) - 1;
    if v < max {
        out.push(flags | v as u8);
        return;
    }
    out.push(flags | max as u8);
    let mut rest = v - max;
    while rest >= 0x80 {
        out.push((rest as u8 & 0x7f) | 0x80);
        rest >>= 7;
    }
    out.push(rest as u8);
}

/// A string literal whose length has an `n`-bit prefix, its Huffman flag the bit above it.
fn string(buf: &[u8], n: u32) -> Result<(Vec<u8>, usize), QpackError> {
    let huffman = buf.first().is_some_and(|b| b & (1 << n) != 0);
    let (len, at) = int(buf, n)?;
    let end = usize::try_from(len)
        .ok()
        .and_then(|l| at.checked_add(l))
        .filter(|e| *e <= buf.len())
        .ok_or(QpackError::Malformed("field section cut short"))?;
    let raw = &buf[at..end];
    let s = match huffman {
        true => huffman_decode(raw)?,
        false => raw.to_vec(),
    };
    Ok((s, end))
}

/// The decoding tree of the Huffman code: node `i`'s children at `2i` and `2i + 1` of the
/// vector, each a next node (`NODE | index`) or a symbol.
const NODE: u16 = 0x8000;
const EMPTY: u16 = 0xffff;

fn tree() -> &'static Vec<u16> {
    static TREE: OnceLock<Vec<u16>> = OnceLock::new();
    TREE.get_or_init(|| {
        let mut t = vec![EMPTY, EMPTY];
        for (sym, &(code, len)) in HUFFMAN.iter().enumerate() {
            let mut node = 0usize;
            for bit in (0..len).rev() {
                let slot = 2 * node + ((code >> bit) & 1) as usize;
                if bit == 0 {
                    t[slot] = sym as u16;
                } else {
                    if t[slot] == EMPTY {
                        t[slot] = NODE | (t.len() / 2) as u16;
                        t.extend_from_slice(&[EMPTY, EMPTY]);
                    }
                    node = usize::from(t[slot] & !NODE);
                }
            }
        }
        t
    })
}

/// A Huffman-coded string (RFC 7541 section 5.2): padding of at most 7 bits, all ones (the
/// start of EOS); EOS itself or any other end is an error.
pub fn huffman_decode(coded: &[u8]) -> Result<Vec<u8>, QpackError> {
    let t = tree();
    let mut out = Vec::with_capacity(coded.len() * 8 / 5);
    let mut node = 0usize;
    // Bits read since the last symbol, and whether all were ones.
    let (mut pending, mut ones) = (0u32, true);
    for byte in coded {
        for bit in (0..8).rev() {
            let b = (byte >> bit) & 1;
            pending += 1;
            ones &= b == 1;
            match t[2 * node + usize::from(b)] {
                EMPTY => return Err(QpackError::Malformed("Huffman code for EOS or none")),
                next if next & NODE != 0 => node = usize::from(next & !NODE),
                sym => {
                    out.push(sym as u8);
                    node = 0;
                    (pending, ones) = (0, true);
                }
            }
        }
    }
    if pending > 7 || !ones {
        return Err(QpackError::Malformed("Huffman string with bad padding"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// RFC 7541 appendix C.4.1's Huffman-coded "www.example.com", and C.4.2's "no-cache".
    #[test]
    fn huffman_strings_of_the_rfc() {
        let www = [
            0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
        ];
        assert_eq!(huffman_decode(&www).unwrap(), b"www.example.com");
        let no_cache = [0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf];
        assert_eq!(huffman_decode(&no_cache).unwrap(), b"no-cache");
        assert_eq!(huffman_decode(&[]).unwrap(), b"");
        // A whole byte of padding, and padding of zeros.
        assert!(huffman_decode(&[0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf, 0xff]).is_err());
        assert!(huffman_decode(&[0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xb0]).is_err());
        // EOS (30 ones).
        assert!(huffman_decode(&[0xff, 0xff, 0xff, 0xfc]).is_err());
    }

    /// RFC 7541 appendix C.1's prefix integers.
    #[test]
    fn prefix_integers() {
        assert_eq!(int(&[0x0a], 5), Ok((10, 1)));
        assert_eq!(int(&[0x1f, 0x9a, 0x0a], 5), Ok((1337, 3)));
        assert_eq!(int(&[0x2a], 8), Ok((42, 1)));
        assert!(int(&[0x1f, 0x9a], 5).is_err());
        assert!(int(&[0xff; 12], 8).is_err());
        for v in [0u64, 30, 31, 127, 128, 1337, 1 << 40] {
            let mut out = Vec::new();
            put_int(&mut out, 0xe0, 5, v);
            assert_eq!(int(&out, 5), Ok((v, out.len())));
        }
    }

    #[test]
    fn a_section_round_trips() {
        let fields = [
            (":method", "CONNECT"),
            (":protocol", "connect-ip"),
            (":scheme", "https"),
            (":authority", "vpn.example:443"),
            (":path", "/.well-known/masque/ip/*/*/"),
            ("capsule-protocol", "?1"),
            ("authorization", "Bearer mpq_x"),
        ];
        let enc = encode(fields);
        let dec = decode(&enc, 16 * 1024).unwrap();
        let got: Vec<(&[u8], &[u8])> = dec
            .iter()
            .map(|(n, v)| (n.as_slice(), v.as_slice()))
            .collect();
        let want: Vec<(&[u8], &[u8])> = fields
            .iter()
            .map(|(n, v)| (n.as_bytes(), v.as_bytes()))
            .collect();
        assert_eq!(got, want);
        // :method CONNECT is static entry 15, one byte.
        assert_eq!(enc[2], 0xc0 | 15);
        assert_eq!(decode(&enc, 100), Err(QpackError::TooLarge));
    }

    /// A section as quic-go's encoder writes it (Huffman literals with static name references),
    /// and what refers to a dynamic table.
    #[test]
    fn sections_of_other_encoders_and_forbidden_references() {
        // :status 200 (static 25), then "capsule-protocol: ?1" as a literal name, Huffman.
        let mut sec = vec![0x00, 0x00, 0xc0 | 25];
        let name = b"capsule-protocol";
        put_int(&mut sec, 0x20, 3, name.len() as u64);
        sec.extend_from_slice(name);
        // "?1" Huffman-coded: `?` = 0x3fc (10 bits), '1' = 0x1 (5 bits), one bit of padding.
        sec.extend_from_slice(&[0x82, 0xff, 0x03]);
        let got = decode(&sec, 4096).unwrap();
        assert_eq!(got[0], (b":status".to_vec(), b"200".to_vec()));
        assert_eq!(got[1], (name.to_vec(), b"?1".to_vec()));
        // A CONNECT-IP request and its answer as quic-go's encoder (github.com/quic-go/qpack
        // v0.6.0, the one connect-ip-go uses) wrote them.
        let request = hex("0000cf2f00b95d8749c87a3f8721eaa8a44ac6afd7508b08177df5c0b89b6ae34d335195617f05a285bad47f153148d1dad2b06ad8f963e58f2f0420eb45b4156aec3a4e43d182ff035f458fba51d85b14a6bed17ed2ff7e74e1f55f508921eaa8a44ac6ad698f");
        let text = |f: &Field| {
            format!(
                "{}: {}",
                String::from_utf8_lossy(&f.0),
                String::from_utf8_lossy(&f.1)
            )
        };
        let got: Vec<String> = decode(&request, 4096).unwrap().iter().map(text).collect();
        assert_eq!(
            got,
            [
                ":method: CONNECT",
                ":protocol: connect-ip",
                ":scheme: https",
                ":authority: 10.99.0.254:443",
                ":path: /.well-known/masque/ip/*/*/",
                "capsule-protocol: ?1",
                "authorization: Bearer mpq_Zm9vYmFy",
                "user-agent: connect-ip-go",
            ]
        );
        let answer = hex("0000d92f0420eb45b4156aec3a4e43d182ff03");
        let got: Vec<String> = decode(&answer, 4096).unwrap().iter().map(text).collect();
        assert_eq!(got, [":status: 200", "capsule-protocol: ?1"]);
        for bad in [
            &[0x01, 0x00][..],
            &[0x00, 0x00, 0x80],
            &[0x00, 0x00, 0x40, 0x00],
            &[0x00, 0x00, 0x10],
            &[0x00, 0x00, 0xc0 | 63, 0x30],
            &[0x00, 0x00, 0x5f, 0x0a, 0x05, b'a'],
        ] {
            assert!(decode(bad, 4096).is_err(), "{bad:?}");
        }
    }
}
