#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;

use hypha_dataset::{
    Dataset,
    prepare::{self, Options, Source, arrays::Arrays, images::Images, text::Text},
    slice, verify,
};

fn npy(path: &Path, descr: &str, shape: &[usize], data: &[u8]) {
    let shape_text = match shape {
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

fn options(slice_size: u64) -> Options {
    Options {
        slice_size,
        ..Options::default()
    }
}

fn tensor(dataset: &Dataset, index: u64, name: &str) -> Vec<u8> {
    let bytes = std::fs::read(dataset.slice_path(index).unwrap()).unwrap();
    let (_, plain) = slice::decode(&bytes).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&plain).unwrap();
    tensors.tensor(name).unwrap().data().to_vec()
}

#[test]
fn npy_arrays_become_slices_of_matching_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("arrays");
    std::fs::create_dir(&input).unwrap();
    let features: Vec<f32> = (0..10 * 3).map(|i| i as f32).collect();
    npy(
        &input.join("features.npy"),
        "<f4",
        &[10, 3],
        &features
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>(),
    );
    let labels: Vec<i64> = (0..10).collect();
    npy(
        &input.join("labels.npy"),
        "<i8",
        &[10],
        &labels
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>(),
    );

    let source = Arrays::open(&input).unwrap();
    let out = tmp.path().join("tabular");
    let manifest = prepare::write_dataset(&source, &out, &options(4), &|_| {}).unwrap();
    assert_eq!(manifest.name, "tabular");
    assert_eq!(
        manifest
            .slices
            .iter()
            .map(|s| s.samples)
            .collect::<Vec<_>>(),
        [Some(4), Some(4), Some(2)]
    );

    let dataset = Dataset::open(&out).unwrap();
    assert_eq!(
        dataset.manifest(),
        &manifest,
        "the written manifest is the one on disk"
    );
    assert!(verify(&dataset, |_| {}).is_empty());
    // Slice 1 holds rows 4..8 of both columns.
    let got: Vec<f32> = tensor(&dataset, 1, "features")
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, features[12..24]);
    let got: Vec<i64> = tensor(&dataset, 2, "labels")
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, [8, 9]);
}

#[test]
fn a_safetensors_file_is_sliced_by_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("all.safetensors");
    let tensors = slice::Tensors::new()
        .with("x", slice::Dtype::U8, vec![6, 2], (0..12).collect())
        .unwrap();
    std::fs::write(
        &input,
        slice::encode(&tensors, slice::Encoding::Plain).unwrap(),
    )
    .unwrap();
    let out = tmp.path().join("xs");
    prepare::write_dataset(&Arrays::open(&input).unwrap(), &out, &options(5), &|_| {}).unwrap();
    let dataset = Dataset::open(&out).unwrap();
    assert_eq!(tensor(&dataset, 1, "x"), [10, 11]);
}

#[test]
fn jsonl_is_tokenised_into_padded_sequences() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("corpus.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"hi\"}\n\n{\"text\": \"abc\", \"id\": 2}\n",
    )
    .unwrap();
    let source = Text::open(&input, "text", 4, None).unwrap();
    assert_eq!(source.samples(), 2);
    let out = tmp.path().join("corpus");
    prepare::write_dataset(&source, &out, &options(8), &|_| {}).unwrap();
    let dataset = Dataset::open(&out).unwrap();
    let ids: Vec<i32> = tensor(&dataset, 0, "input_ids")
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let eos = prepare::text::EOS;
    let pad = prepare::text::PAD;
    assert_eq!(ids, [104, 105, eos, 97, 98, 99, eos, pad]);
    assert_eq!(
        tensor(&dataset, 0, "attention_mask"),
        [1, 1, 1, 1, 1, 1, 1, 0]
    );

    std::fs::write(&input, "{\"body\": \"x\"}\n").unwrap();
    let err = Text::open(&input, "text", 4, None).unwrap_err();
    assert!(
        err.to_string().contains("line 1: no string field \"text\""),
        "{err}"
    );
}

/// A folder of a user's text: plain files are one document each, JSONL files one a line,
/// nested folders are walked in path order, hidden files are left out, and a file that is not
/// text is named in the error.
#[test]
fn a_folder_of_text_files_and_jsonl_is_tokenised_in_path_order() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("my text");
    std::fs::create_dir_all(input.join("b-chapter/deeper")).unwrap();
    std::fs::write(input.join("a.txt"), "ab").unwrap();
    std::fs::write(input.join("b-chapter/deeper/c.md"), "c").unwrap();
    std::fs::write(
        input.join("b-chapter/d.jsonl"),
        "{\"text\":\"d\"}\n{\"text\":\"é\"}\n",
    )
    .unwrap();
    std::fs::write(input.join(".notes.txt"), "hidden").unwrap();
    let source = Text::open(&input, "text", 3, None).unwrap();
    let ids: Vec<i32> = source
        .read(0, 0, source.samples())
        .unwrap()
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let eos = prepare::text::EOS;
    let pad = prepare::text::PAD;
    assert_eq!(
        ids,
        [97, 98, eos, 100, eos, 0xc3, 0xa9, eos, 99, eos, pad, pad]
    );

    std::fs::write(
        input.join("b-chapter/picture.png"),
        [0x89, b'P', b'N', b'G', 0xff],
    )
    .unwrap();
    let err = Text::open(&input, "text", 3, None).unwrap_err().to_string();
    assert!(
        err.contains("picture.png") && err.contains("not UTF-8 text"),
        "{err}"
    );
}

#[test]
fn image_folders_are_decoded_resized_and_labelled() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("pets");
    for (class, colour) in [("cats", [255u8, 0, 0]), ("dogs", [0, 0, 255])] {
        std::fs::create_dir_all(input.join(class)).unwrap();
        for i in 0..2 {
            let image = image::RgbImage::from_pixel(8 + i, 6, image::Rgb(colour));
            image
                .save(input.join(class).join(format!("{i}.png")))
                .unwrap();
        }
    }
    let source = Images::open(&input, 4).unwrap();
    assert_eq!(source.classes(), ["cats", "dogs"]);
    let out = tmp.path().join("pets-4px");
    prepare::write_dataset(&source, &out, &options(3), &|_| {}).unwrap();
    let classes: Vec<String> =
        serde_json::from_slice(&std::fs::read(out.join("classes.json")).unwrap()).unwrap();
    assert_eq!(classes, ["cats", "dogs"]);
    let dataset = Dataset::open(&out).unwrap();
    let labels: Vec<i64> = tensor(&dataset, 0, "labels")
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(labels, [0, 0, 1]);
    let pixels: Vec<f32> = tensor(&dataset, 1, "images")
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(pixels.len(), 3 * 4 * 4, "one image of 3×4×4");
    assert!(
        pixels[..16].iter().all(|v| *v == 0.0),
        "a blue dog has no red"
    );
    assert!(
        pixels[32..].iter().all(|v| (*v - 1.0).abs() < 1e-6),
        "and full blue"
    );
}

/// A source that fails after its first slice.
struct Failing(Vec<prepare::Column>);

impl Source for Failing {
    fn columns(&self) -> &[prepare::Column] {
        &self.0
    }
    fn samples(&self) -> u64 {
        10
    }
    fn read(&self, _: usize, start: u64, count: u64) -> Result<Vec<u8>, prepare::PrepareError> {
        if start > 0 {
            return Err(prepare::PrepareError::Empty);
        }
        Ok(vec![0; count as usize])
    }
}

#[test]
fn a_failed_preparation_leaves_nothing_behind_and_existing_output_is_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let source = Failing(vec![prepare::Column {
        name: "x".into(),
        dtype: slice::Dtype::U8,
        sample_shape: vec![],
    }]);
    let out = tmp.path().join("broken");
    let opts = Options {
        slice_size: 2,
        threads: 1,
        ..Options::default()
    };
    assert!(prepare::write_dataset(&source, &out, &opts, &|_| {}).is_err());
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "no output and no staging directory"
    );

    std::fs::create_dir(&out).unwrap();
    let err = prepare::write_dataset(&source, &out, &opts, &|_| {}).unwrap_err();
    assert!(err.to_string().contains("--force"), "{err}");
}

#[test]
fn a_tokenizer_json_replaces_byte_level_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    // A word-level tokenizer in Hugging Face's tokenizer.json format, written out by hand.
    let tokenizer = r#"{
      "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
      "normalizer": null,
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": null, "decoder": null,
      "model": {"type": "WordLevel", "unk_token": "<unk>",
                "vocab": {"<unk>": 0, "<pad>": 1, "</s>": 2, "hello": 3, "hypha": 4, "world": 5}}
    }"#;
    let tokenizer_path = tmp.path().join("tokenizer.json");
    std::fs::write(&tokenizer_path, tokenizer).unwrap();
    let input = tmp.path().join("corpus.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"hello hypha\"}\n{\"text\": \"hello unknown world\"}\n",
    )
    .unwrap();
    let source = Text::open(&input, "text", 4, Some(&tokenizer_path)).unwrap();
    let out = tmp.path().join("tok");
    prepare::write_dataset(&source, &out, &options(8), &|_| {}).unwrap();
    let dataset = Dataset::open(&out).unwrap();
    let ids: Vec<i32> = tensor(&dataset, 0, "input_ids")
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(
        ids,
        [3, 4, 2, 3, 0, 5, 2, 1],
        "words, </s> after each document, <pad> to the end"
    );
    assert_eq!(
        tensor(&dataset, 0, "attention_mask"),
        [1, 1, 1, 1, 1, 1, 1, 0]
    );

    std::fs::write(&tokenizer_path, "{}").unwrap();
    let err = Text::open(&input, "text", 4, Some(&tokenizer_path)).unwrap_err();
    assert!(
        err.to_string().contains("not a usable tokenizer.json"),
        "{err}"
    );
}
