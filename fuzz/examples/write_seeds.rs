//! Writes the seed corpus: `cargo run --example write_seeds` (from `fuzz/`), then
//! `cargo fuzz run stream_reader` / `framed_reader` start from `corpus/<target>/`.

use std::fs;
use std::path::Path;

use presenced_fuzz::{seed, seed_docs, DEFAULT_LIMITS};

fn main() -> std::io::Result<()> {
    for (target, framed) in [("stream_reader", false), ("framed_reader", true)] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("corpus")
            .join(target);
        fs::create_dir_all(&dir)?;
        for (i, doc) in seed_docs(framed).iter().enumerate() {
            // Each document with the default limits, then with tight ones (64 bytes, depth 4)
            // split in two, so both the accept and the limit paths start covered.
            fs::write(dir.join(format!("seed-{i:02}")), seed(DEFAULT_LIMITS, doc))?;
            let mut tight = vec![0b100_010, 1];
            let mid = u16::try_from(doc.len() / 2).unwrap_or(u16::MAX);
            tight.extend_from_slice(&mid.to_le_bytes());
            tight.extend_from_slice(doc);
            fs::write(dir.join(format!("seed-{i:02}-tight")), tight)?;
        }
        println!("{}: {} seeds", dir.display(), 2 * seed_docs(framed).len());
    }
    Ok(())
}
