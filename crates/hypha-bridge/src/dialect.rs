//! The upstream client's dialect in the generated schemas: serde reads aliases, these make
//! `openapi.json` say so.

use schemars::Schema;
use serde_json::{Value, json};

/// Documents `alias` as another name of the property `field`: the property is listed under
/// both names, and a required `field` becomes "one of the two".
pub fn alias(schema: &mut Schema, field: &str, alias: &str) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    let Some(properties) = object.get_mut("properties").and_then(Value::as_object_mut) else {
        return;
    };
    let Some(mut aliased) = properties.get(field).cloned() else {
        return;
    };
    if let Some(aliased) = aliased.as_object_mut() {
        aliased.insert(
            "description".into(),
            format!("`{field}`, as the upstream Hypha client names it.").into(),
        );
    }
    properties.insert(alias.into(), aliased);
    let required = object.get_mut("required").and_then(Value::as_array_mut);
    if let Some(required) = required
        && let Some(at) = required.iter().position(|name| name == field)
    {
        required.remove(at);
        let either = json!({ "required": [field] });
        let or = json!({ "required": [alias] });
        match object.get_mut("allOf").and_then(Value::as_array_mut) {
            Some(all) => all.push(json!({ "oneOf": [either, or] })),
            None => {
                object.insert("allOf".into(), json!([{ "oneOf": [either, or] }]));
            }
        }
    }
}

/// Documents that an internally tagged enum's `type` is read in lower case too: each
/// variant's `"const": "Name"` becomes `"enum": ["Name", "name"]`.
pub fn lower_case_tags(schema: &mut Schema) {
    let Some(variants) = schema
        .as_object_mut()
        .and_then(|o| o.get_mut("oneOf"))
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    for variant in variants {
        let tag = variant
            .pointer_mut("/properties/type")
            .and_then(Value::as_object_mut);
        if let Some(tag) = tag
            && let Some(Value::String(name)) = tag.remove("const")
        {
            let lower = name.to_lowercase();
            let names = if lower == name {
                vec![name]
            } else {
                vec![name, lower]
            };
            tag.insert("enum".into(), names.into());
        }
    }
}
