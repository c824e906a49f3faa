#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;

use hypha_dataset::{Dataset, Error, MANIFEST_FILE, ManifestSource, slice, verify};

/// A SafeTensors buffer built by hand from the format's specification (8-byte little-endian
/// header length, JSON header, raw little-endian data), independent of any library.
fn reference_safetensors(images: &[f32], labels: &[i64]) -> Vec<u8> {
    let image_bytes: Vec<u8> = images.iter().flat_map(|v| v.to_le_bytes()).collect();
    let label_bytes: Vec<u8> = labels.iter().flat_map(|v| v.to_le_bytes()).collect();
    let n = labels.len();
    let header = format!(
        r#"{{"images":{{"dtype":"F32","shape":[{n},{}],"data_offsets":[0,{}]}},"labels":{{"dtype":"I64","shape":[{n}],"data_offsets":[{},{}]}}}}"#,
        images.len() / n,
        image_bytes.len(),
        image_bytes.len(),
        image_bytes.len() + label_bytes.len()
    );
    let mut header = header.into_bytes();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&image_bytes);
    out.extend_from_slice(&label_bytes);
    out
}

/// `snappy.compress(...)` of python-snappy is the raw block format.
fn seed_recipe(images: &[f32], labels: &[i64]) -> Vec<u8> {
    snap::raw::Encoder::new()
        .compress_vec(&reference_safetensors(images, labels))
        .unwrap()
}

fn dataset_dir(parent: &Path, name: &str) -> std::path::PathBuf {
    let dir = parent.join(name);
    std::fs::create_dir(&dir).unwrap();
    dir
}

#[test]
fn seed_recipe_slices_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset_dir(tmp.path(), "imagenet-1k");
    let images: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
    let bytes = seed_recipe(&images, &[3, 1, 4]);
    std::fs::write(dir.join("slice-0000.safetensors"), &bytes).unwrap();

    let (encoding, plain) = slice::decode(&bytes).unwrap();
    assert_eq!(encoding, slice::Encoding::Snappy);
    assert_eq!(
        &*plain,
        reference_safetensors(&images, &[3, 1, 4]).as_slice()
    );
    let tensors = safetensors::SafeTensors::deserialize(&plain).unwrap();
    let labels = tensors.tensor("labels").unwrap();
    assert_eq!(
        labels.data(),
        [3i64, 1, 4]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>()
            .as_slice()
    );

    let dataset = Dataset::open(&dir).unwrap();
    assert_eq!(dataset.name(), "imagenet-1k");
    let entry = &dataset.manifest().slices[0];
    assert_eq!(entry.encoding, slice::Encoding::Snappy);
    assert_eq!(entry.samples, Some(3));
    assert_eq!(entry.size, bytes.len() as u64);
    assert_eq!(entry.uncompressed_size, plain.len() as u64);
    assert_eq!(entry.blake3, blake3::hash(&bytes).to_hex().to_string());
    let names: Vec<(&str, &str, &[u64])> = entry
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.dtype.as_str(), t.shape.as_slice()))
        .collect();
    assert_eq!(
        names,
        vec![
            ("images", "F32", &[3u64, 4][..]),
            ("labels", "I64", &[3u64][..])
        ]
    );

    // Our encoder writes what the recipe writes.
    let ours = slice::Tensors::new()
        .with(
            "images",
            slice::Dtype::F32,
            vec![3, 4],
            images.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
        .unwrap()
        .with(
            "labels",
            slice::Dtype::I64,
            vec![3],
            [3i64, 1, 4].iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
        .unwrap();
    let encoded = slice::encode(&ours, slice::Encoding::Snappy).unwrap();
    let (_, decoded) = slice::decode(&encoded).unwrap();
    assert_eq!(
        slice::describe(&decoded).unwrap(),
        slice::describe(&plain).unwrap()
    );
}

#[test]
fn plain_safetensors_files_are_accepted_by_content() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset_dir(tmp.path(), "plain");
    let bytes = reference_safetensors(&[1.0, 2.0], &[7, 8]);
    std::fs::write(dir.join("slice-0.safetensors"), &bytes).unwrap();
    let dataset = Dataset::open(&dir).unwrap();
    let entry = &dataset.manifest().slices[0];
    assert_eq!(entry.encoding, slice::Encoding::Plain);
    assert_eq!(entry.size, entry.uncompressed_size);
    assert_eq!(entry.samples, Some(2));
}

#[test]
fn slice_order_is_numeric() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset_dir(tmp.path(), "ordered");
    for i in [10, 2, 9, 1] {
        std::fs::write(
            dir.join(format!("slice-{i}.safetensors")),
            seed_recipe(&[i as f32], &[i]),
        )
        .unwrap();
    }
    std::fs::write(dir.join("README.txt"), "not a slice").unwrap();
    let dataset = Dataset::open(&dir).unwrap();
    let files: Vec<&str> = dataset
        .manifest()
        .slices
        .iter()
        .map(|s| s.file.as_str())
        .collect();
    assert_eq!(
        files,
        [
            "slice-1.safetensors",
            "slice-2.safetensors",
            "slice-9.safetensors",
            "slice-10.safetensors"
        ]
    );
    assert_eq!(
        dataset.slice_path(3).unwrap(),
        dir.join("slice-10.safetensors")
    );
    assert_eq!(
        dataset.slice_path(4),
        None,
        "index == count is past the end"
    );
}

#[test]
fn written_manifest_is_used_until_the_directory_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset_dir(tmp.path(), "d");
    std::fs::write(dir.join("slice-0.safetensors"), seed_recipe(&[1.0], &[1])).unwrap();
    let dataset = Dataset::open(&dir).unwrap();
    dataset.write_manifest().unwrap();
    let text = std::fs::read_to_string(dir.join(MANIFEST_FILE)).unwrap();
    assert!(text.contains("\"format\": \"hypha-dataset/1\""), "{text}");
    assert_eq!(Dataset::open(&dir).unwrap().manifest(), dataset.manifest());

    // A new slice makes the stored manifest stale: it is derived again.
    std::fs::write(
        dir.join("slice-1.safetensors"),
        seed_recipe(&[2.0, 3.0], &[2, 3]),
    )
    .unwrap();
    let reopened = Dataset::open(&dir).unwrap();
    assert_eq!(reopened.manifest().slices.len(), 2);
    assert_eq!(reopened.manifest().samples(), 3);
}

#[test]
fn verify_names_corrupted_and_truncated_slices() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset_dir(tmp.path(), "d");
    for i in 0..3 {
        std::fs::write(
            dir.join(format!("slice-{i}.safetensors")),
            seed_recipe(&[i as f32; 64], &[i; 16]),
        )
        .unwrap();
    }
    let dataset = Dataset::open(&dir).unwrap();
    dataset.write_manifest().unwrap();
    assert!(verify(&dataset, |_| {}).is_empty());

    let path = dir.join("slice-1.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x55;
    std::fs::write(&path, &bytes).unwrap();
    let truncated = dir.join("slice-2.safetensors");
    let bytes = std::fs::read(&truncated).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() - 5]).unwrap();

    let problems = verify(&dataset, |_| {});
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert_eq!(problems[0].file, "slice-1.safetensors");
    assert!(problems[0].problem.contains("corrupted"), "{}", problems[0]);
    assert_eq!(problems[1].file, "slice-2.safetensors");
    assert!(problems[1].problem.contains("truncated"), "{}", problems[1]);
}

#[test]
fn unreadable_slices_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset_dir(tmp.path(), "d");
    std::fs::write(dir.join("slice-0.safetensors"), b"definitely not tensors").unwrap();
    let err = Dataset::open(&dir).unwrap_err();
    assert!(matches!(err, Error::Slice { .. }), "{err}");
    assert!(err.to_string().contains("slice-0.safetensors"), "{err}");

    // A Snappy header claiming an absurd length is refused before any allocation: 4 GiB is
    // above any slice's size, and no six bytes of Snappy expand to 1 MiB.
    let hostile = [0xff, 0xff, 0xff, 0xff, 0x0f, 0x00];
    let err = slice::decode(&hostile).unwrap_err().to_string();
    assert!(err.contains("more than the 2147483648 allowed"), "{err}");
    let hostile = [0x80, 0x80, 0x40, 0x00, 0x00, 0x00];
    let err = slice::decode(&hostile).unwrap_err().to_string();
    assert!(err.contains("more than Snappy can expand to"), "{err}");
    // The most compressible slice there is still decodes.
    let zeros = slice::Tensors::new()
        .with("x", slice::Dtype::U8, vec![1 << 20], vec![0; 1 << 20])
        .unwrap();
    let packed = slice::encode(&zeros, slice::Encoding::Snappy).unwrap();
    assert!(packed.len() < (1 << 20) / 16, "{} bytes", packed.len());
    slice::decode(&packed).unwrap();

    let empty = dataset_dir(tmp.path(), "empty");
    let err = Dataset::open(&empty).unwrap_err();
    assert!(matches!(err, Error::Empty { .. }), "{err}");
}

#[test]
fn a_derived_manifest_once_stored_catches_later_damage() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset_dir(tmp.path(), "digits");
    for i in 0..3 {
        let path = dir.join(format!("slice-{i}.safetensors"));
        std::fs::write(&path, seed_recipe(&[i as f32 + 0.5; 64], &[i; 16])).unwrap();
        // Written a while ago, as a dataset is: file times come from the kernel's coarse
        // clock (a few ms), and a manifest written in the same tick as its slices ties with
        // them, which counts as changed (a CI run failed so).
        let earlier = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_modified(earlier))
            .unwrap();
    }
    let external = hypha_dataset::external_manifest_path(&tmp.path().join("state"), &dir);
    let derived = Dataset::open_with(&dir, Some(&external)).unwrap();
    assert_eq!(derived.source(), &ManifestSource::Derived);
    // A writable dataset keeps its manifest beside its slices.
    let stored_at = derived.store_manifest(&external).unwrap();
    assert_eq!(stored_at, dir.join(MANIFEST_FILE));
    let reopened = Dataset::open_with(&dir, Some(&external)).unwrap();
    assert_eq!(
        reopened.source(),
        &ManifestSource::Stored(stored_at.clone())
    );

    // The flipped file keeps its time, so the stored manifest stays in use and its hash
    // catches the change (derived afresh, a flip that still decodes would pass as good).
    hypha_dataset::testing::flip_a_bit_silently(&dir.join("slice-1.safetensors"));
    let reopened = Dataset::open_with(&dir, Some(&external)).unwrap();
    assert_eq!(reopened.source(), &ManifestSource::Stored(stored_at));
    let problems = verify(&reopened, |_| {});
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].file, "slice-1.safetensors");
    assert!(problems[0].problem.contains("corrupted"), "{}", problems[0]);
}

#[test]
fn a_slice_truncated_after_the_manifest_keeps_the_stored_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset_dir(tmp.path(), "digits");
    for i in 0..3 {
        std::fs::write(
            dir.join(format!("slice-{i}.safetensors")),
            seed_recipe(&[i as f32; 64], &[i; 16]),
        )
        .unwrap();
    }
    Dataset::open(&dir).unwrap().write_manifest().unwrap();
    let truncated = dir.join("slice-2.safetensors");
    let bytes = std::fs::read(&truncated).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&truncated, &bytes[..bytes.len() - 5]).unwrap();

    // The slice is newer than the manifest, so the directory is described again; that fails
    // on the truncated slice, and the stored manifest stays, so the other slices stay usable.
    let dataset = Dataset::open(&dir).unwrap();
    match dataset.source() {
        ManifestSource::Kept { problem, .. } => {
            assert!(problem.contains("slice-2.safetensors"), "{problem}")
        }
        other => panic!("expected the stored manifest kept, got {other:?}"),
    }
    assert_eq!(dataset.manifest().slices.len(), 3);
    let problems = verify(&dataset, |_| {});
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].problem.contains("truncated"), "{}", problems[0]);
}

#[test]
fn without_a_manifest_every_slice_is_decoded_and_each_failure_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset_dir(tmp.path(), "d");
    for i in 0..4 {
        std::fs::write(
            dir.join(format!("slice-{i}.safetensors")),
            seed_recipe(&[i as f32; 64], &[i; 16]),
        )
        .unwrap();
    }
    let truncated = dir.join("slice-1.safetensors");
    let bytes = std::fs::read(&truncated).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    std::fs::write(dir.join("slice-3.safetensors"), b"not a slice at all").unwrap();

    let mut checked = 0;
    let (count, problems) = hypha_dataset::check_decodes(&dir, |_| checked += 1).unwrap();
    assert_eq!((count, checked), (4, 2));
    let files: Vec<&str> = problems.iter().map(|p| p.file.as_str()).collect();
    assert_eq!(files, ["slice-1.safetensors", "slice-3.safetensors"]);
    assert!(problems.iter().all(|p| p.problem.contains("undecodable")));
}

#[test]
fn a_read_only_dataset_stores_its_manifest_elsewhere() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = dataset_dir(tmp.path(), "digits");
    std::fs::write(
        dir.join("slice-0.safetensors"),
        seed_recipe(&[1.0; 8], &[1, 2]),
    )
    .unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::write(dir.join("probe"), b"").is_ok() {
        // Root writes into a 0555 directory regardless.
        std::fs::remove_file(dir.join("probe")).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        eprintln!("skipped: this user can write into read-only directories (root)");
        return;
    }
    let external = hypha_dataset::external_manifest_path(&tmp.path().join("state"), &dir);
    let dataset = Dataset::open_with(&dir, Some(&external)).unwrap();
    assert_eq!(dataset.store_manifest(&external).unwrap(), external);
    assert!(!dir.join(MANIFEST_FILE).exists());
    let reopened = Dataset::open_with(&dir, Some(&external)).unwrap();
    assert_eq!(reopened.source(), &ManifestSource::Stored(external));
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}
