use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::de::DeserializeOwned;

use crate::{ConfigError, DefaultValue, Key, Kind, Origin, Schema};

/// Builds a node's settings layer by layer; see the crate documentation for the order.
#[derive(Debug)]
pub struct Layers<'s> {
    schema: &'s Schema,
    table: toml::Table,
    origins: BTreeMap<String, Origin>,
    file: Option<PathBuf>,
    ignored: Vec<IgnoredVariable>,
}

/// A `HYPHA_*` variable that names no setting of the program: ignored, since the variables of
/// one shell reach every Hypha program (a worker's `HYPHA_WORK_DIR` reaches the scheduler
/// too). The program says so once it can log: a warning where a setting of its own is close
/// (a typo, most likely), a debug line otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IgnoredVariable {
    /// The variable's name.
    pub name: String,
    /// The program's closest setting, as a variable (`HYPHA_WORK_DIR`).
    pub closest: Option<String>,
}

impl std::fmt::Display for IgnoredVariable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.closest {
            Some(closest) => write!(
                f,
                "{} names no setting of this program and is ignored; did you mean {closest}?",
                self.name
            ),
            None => write!(
                f,
                "{} names no setting of this program (another Hypha program's, or a stray) and is ignored",
                self.name
            ),
        }
    }
}

/// The merged settings, with the origin of every value.
#[derive(Debug, Clone)]
pub struct Loaded {
    program: &'static str,
    table: toml::Table,
    origins: BTreeMap<String, Origin>,
    schema: Schema,
    ignored: Vec<IgnoredVariable>,
}

impl<'s> Layers<'s> {
    /// Starts from the schema's defaults.
    pub fn new(schema: &'s Schema) -> Self {
        let mut layers = Layers {
            schema,
            table: toml::Table::new(),
            origins: BTreeMap::new(),
            file: None,
            ignored: Vec::new(),
        };
        for key in schema.keys() {
            layers.apply_default(key, "");
        }
        layers
    }

    fn apply_default(&mut self, key: &Key, prefix: &str) {
        let path = join(prefix, key.name);
        match (key.kind, key.default) {
            (Kind::Table(children), _) => {
                for child in children {
                    self.apply_default(child, &path);
                }
            }
            (_, DefaultValue::Value(literal)) => {
                // Schema defaults are written by us; a malformed one is a bug caught by tests.
                if let Ok(value) = parse_literal(literal) {
                    set(&mut self.table, &path, value);
                    self.origins.insert(path, Origin::Default);
                }
            }
            _ => {}
        }
    }

    /// Adds a TOML config file.
    pub fn file(self, path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::new(
                "config file",
                Origin::File {
                    path: path.to_path_buf(),
                    line: 0,
                    column: 0,
                },
                format!("cannot read it: {e}"),
                "check the path given to --config, or create the file with `init`",
            )
        })?;
        self.file_text(path, &text)
    }

    /// Adds a TOML config file's text; `path` names it in errors and anchors relative paths.
    pub fn file_text(mut self, path: impl AsRef<Path>, text: &str) -> Result<Self, ConfigError> {
        let path = path.as_ref().to_path_buf();
        let at = |offset: usize| {
            let (line, column) = line_column(text, offset);
            Origin::File {
                path: path.clone(),
                line,
                column,
            }
        };
        let syntax_error = |span: Option<std::ops::Range<usize>>, message: &str| {
            ConfigError::new(
                "(syntax)",
                at(span.map(|s| s.start).unwrap_or(0)),
                message.trim().to_string(),
                "correct the TOML syntax at this position",
            )
        };
        let document =
            toml_edit::Document::parse(text).map_err(|e| syntax_error(e.span(), e.message()))?;
        let mut positions = BTreeMap::new();
        record_positions(document.as_table(), "", &mut positions);
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| syntax_error(e.span(), e.message()))?;

        let origin_of = |key: &str| at(positions.get(key).copied().unwrap_or(0));
        check(self.schema, self.schema.keys(), &table, "", &origin_of)?;
        // Relative to the file, and absolute: `run --config worker.toml` must not leave a
        // `work_dir = "work"` relative to the working directory, where an executor started in
        // its job's directory would look for its bridge socket.
        let base = std::path::absolute(&path)
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf))
            .unwrap_or_default();
        anchor_paths(self.schema.keys(), &mut table, &base);

        let mut new_origins = BTreeMap::new();
        collect_paths(&toml::Value::Table(table.clone()), "", &mut |p| {
            new_origins.insert(p.to_string(), origin_of(p));
        });
        self.merge(table, new_origins);
        self.file = Some(path);
        Ok(self)
    }

    /// Adds `HYPHA_*` variables from `vars` (other variables are ignored). A variable that
    /// names no setting of the program is ignored too, and listed in
    /// [`Loaded::ignored_variables`]; one that names a setting with a bad value is an error.
    pub fn env(
        mut self,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut vars: Vec<(String, String)> = vars
            .into_iter()
            .filter(|(name, _)| name.starts_with("HYPHA_"))
            .collect();
        vars.sort();
        for (name, value) in vars {
            let path = name["HYPHA_".len()..]
                .to_ascii_lowercase()
                .replace("__", ".");
            let parts: Vec<&str> = path.split('.').collect();
            if self.schema.find(&parts).is_none() {
                let closest = closest_path(self.schema.keys(), &path)
                    .map(|p| format!("HYPHA_{}", p.replace('.', "__").to_ascii_uppercase()));
                self.ignored.push(IgnoredVariable { name, closest });
                continue;
            }
            let origin = Origin::Env(name.clone());
            let value = self.parse_override(&path, &value, &origin, &format!("unset {name}"))?;
            self.set_override(&path, value, origin)?;
        }
        Ok(self)
    }

    /// Adds a command-line flag's value for `key` (a dotted path), parsed by the key's type.
    pub fn flag(mut self, key: &str, value: &str, flag: &str) -> Result<Self, ConfigError> {
        let origin = Origin::Flag(flag.to_string());
        let value = self.parse_override(key, value, &origin, &format!("correct {flag}"))?;
        self.set_override(key, value, origin)?;
        Ok(self)
    }

    /// Adds a repeatable command-line flag's values for a list key.
    pub fn flag_list(
        mut self,
        key: &str,
        values: &[String],
        flag: &str,
    ) -> Result<Self, ConfigError> {
        let origin = Origin::Flag(flag.to_string());
        let parts: Vec<&str> = key.split('.').collect();
        match self.schema.find(&parts) {
            Some(k) if k.kind.is_list() => {}
            _ => {
                return Err(ConfigError::new(
                    key,
                    origin,
                    format!("{} has no list setting {key}", self.schema.program()),
                    "this is a bug in the program's flags",
                ));
            }
        }
        let list = values.iter().cloned().map(toml::Value::String).collect();
        self.set_override(key, toml::Value::Array(list), origin)?;
        Ok(self)
    }

    fn parse_override(
        &self,
        path: &str,
        raw: &str,
        origin: &Origin,
        fix_unknown: &str,
    ) -> Result<toml::Value, ConfigError> {
        let parts: Vec<&str> = path.split('.').collect();
        let Some(key) = self.schema.find(&parts) else {
            return Err(ConfigError::new(
                path,
                origin.clone(),
                format!("{} has no setting {path}", self.schema.program()),
                match suggest(
                    self.schema.keys(),
                    parts.last().copied().unwrap_or_default(),
                ) {
                    Some(near) => format!("{fix_unknown}, or did you mean {near}?"),
                    None => fix_unknown.to_string(),
                },
            ));
        };
        let bad = |problem: String| {
            ConfigError::new(
                path,
                origin.clone(),
                problem,
                format!("give {}", key.kind.expected()),
            )
        };
        let raw_trimmed = raw.trim();
        Ok(match key.kind {
            Kind::String | Kind::Path => toml::Value::String(raw.to_string()),
            Kind::Integer => toml::Value::Integer(
                raw_trimmed
                    .parse()
                    .map_err(|_| bad(format!("{raw:?} is not an integer")))?,
            ),
            Kind::Float => toml::Value::Float(
                raw_trimmed
                    .parse()
                    .map_err(|_| bad(format!("{raw:?} is not a number")))?,
            ),
            Kind::Bool => toml::Value::Boolean(match raw_trimmed.to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => true,
                "false" | "0" | "no" | "off" => false,
                _ => return Err(bad(format!("{raw:?} is not true or false"))),
            }),
            kind if kind.is_list() && raw_trimmed.starts_with('[') => {
                let value = parse_literal(raw_trimmed)
                    .map_err(|e| bad(format!("{raw:?} is not a TOML array: {e}")))?;
                if !key.kind.matches(&value) {
                    return Err(bad(format!("{raw:?} is not a list of strings")));
                }
                value
            }
            kind if kind.is_list() => toml::Value::Array(
                raw.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| toml::Value::String(s.to_string()))
                    .collect(),
            ),
            Kind::Table(_)
            | Kind::TableArray(_)
            | Kind::Map(_)
            | Kind::StringMap
            | Kind::StringList
            | Kind::Multiaddrs
            | Kind::Cidrs => {
                return Err(ConfigError::new(
                    path,
                    origin.clone(),
                    format!("{path} is a table and cannot be set as one value"),
                    "set its keys one by one (HYPHA_TABLE__KEY), or use the config file",
                ));
            }
        })
    }

    fn set_override(
        &mut self,
        path: &str,
        value: toml::Value,
        origin: Origin,
    ) -> Result<(), ConfigError> {
        let parts: Vec<&str> = path.split('.').collect();
        if let (Some(key), toml::Value::Array(items)) = (self.schema.find(&parts), &value) {
            for (i, item) in items.iter().enumerate() {
                if let toml::Value::String(text) = item
                    && let Err((problem, fix)) = key.kind.check_element(text)
                {
                    return Err(ConfigError::new(
                        format!("{path}[{i}]"),
                        origin,
                        problem,
                        fix,
                    ));
                }
            }
        }
        let mut origins = BTreeMap::new();
        origins.insert(path.to_string(), origin);
        let mut table = toml::Table::new();
        set(&mut table, path, value);
        self.merge(table, origins);
        Ok(())
    }

    /// Deep-merges `table` over the current settings; values it replaces lose their origins.
    fn merge(&mut self, table: toml::Table, origins: BTreeMap<String, Origin>) {
        fn merge_into(
            target: &mut toml::Table,
            source: toml::Table,
            prefix: &str,
            stale: &mut Vec<String>,
        ) {
            for (name, value) in source {
                let path = join(prefix, &name);
                match (target.get_mut(&name), value) {
                    (Some(toml::Value::Table(existing)), toml::Value::Table(incoming)) => {
                        merge_into(existing, incoming, &path, stale);
                    }
                    (_, value) => {
                        stale.push(path);
                        target.insert(name, value);
                    }
                }
            }
        }
        let mut stale = Vec::new();
        merge_into(&mut self.table, table, "", &mut stale);
        for path in stale {
            self.origins.retain(|k, _| {
                !(k == &path
                    || k.starts_with(&format!("{path}."))
                    || k.starts_with(&format!("{path}[")))
            });
        }
        self.origins.extend(origins);
    }

    /// Checks that every required key is set and returns the merged settings.
    pub fn load(self) -> Result<Loaded, ConfigError> {
        let where_missing = match &self.file {
            Some(path) => Origin::File {
                path: path.clone(),
                line: 0,
                column: 0,
            },
            None => Origin::Unset,
        };
        for key in self.schema.keys() {
            require(key, "", &self.table, &where_missing)?;
        }
        Ok(Loaded {
            program: self.schema.program(),
            table: self.table,
            origins: self.origins,
            schema: self.schema.clone(),
            ignored: self.ignored,
        })
    }
}

fn require(
    key: &Key,
    prefix: &str,
    table: &toml::Table,
    origin: &Origin,
) -> Result<(), ConfigError> {
    let path = join(prefix, key.name);
    match (key.kind, key.default) {
        (Kind::Table(children), _) => {
            let empty = toml::Table::new();
            let inner = match table.get(key.name) {
                Some(toml::Value::Table(t)) => t,
                _ => &empty,
            };
            for child in children {
                require(child, &path, inner, origin)?;
            }
            Ok(())
        }
        (Kind::Map(children), _) => {
            if let Some(toml::Value::Table(entries)) = table.get(key.name) {
                for (name, entry) in entries {
                    if let toml::Value::Table(inner) = entry {
                        for child in children {
                            require(child, &join(&path, name), inner, origin)?;
                        }
                    }
                }
            }
            Ok(())
        }
        (_, DefaultValue::Required { example }) if !table.contains_key(key.name) => {
            Err(ConfigError::new(
                &path,
                origin.clone(),
                "required but not set",
                format!(
                    "add `{} = {example}` to the config file, or set HYPHA_{}",
                    key.name,
                    path.to_ascii_uppercase().replace('.', "__")
                ),
            ))
        }
        _ => Ok(()),
    }
}

impl Loaded {
    /// The `HYPHA_*` variables that named no setting of the program, in name order.
    pub fn ignored_variables(&self) -> &[IgnoredVariable] {
        &self.ignored
    }

    /// Deserializes the settings into `T`, which may read any subset of the keys.
    pub fn section<T: DeserializeOwned>(&self) -> Result<T, ConfigError> {
        let value = toml::Value::Table(self.table.clone());
        serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().message().trim().to_string();
            let parts: Vec<&str> = path
                .split(['.', '['])
                .filter(|p| !p.ends_with(']'))
                .collect();
            let fix = match self.schema.find(&parts) {
                Some(Key {
                    default: DefaultValue::Required { example } | DefaultValue::Unset { example },
                    name,
                    ..
                }) => format!("write it like `{name} = {example}`"),
                Some(Key {
                    default: DefaultValue::Value(example),
                    name,
                    ..
                }) => format!("write it like `{name} = {example}`"),
                None => String::new(),
            };
            self.error(&path, inner, fix)
        })
    }

    /// Where the value of `key` came from (falling back to its enclosing key).
    pub fn origin(&self, key: &str) -> Origin {
        let mut path = key.to_string();
        loop {
            if let Some(origin) = self.origins.get(&path) {
                return origin.clone();
            }
            match path.rfind(['.', '[']) {
                Some(i) => path.truncate(i),
                None => return Origin::Default,
            }
        }
    }

    /// An error about `key`, located at its origin.
    pub fn error(
        &self,
        key: &str,
        problem: impl Into<String>,
        fix: impl Into<String>,
    ) -> ConfigError {
        ConfigError::new(key, self.origin(key), problem, fix)
    }

    /// The program these settings are for.
    pub fn program(&self) -> &'static str {
        self.program
    }

    /// The merged settings as TOML.
    pub fn table(&self) -> &toml::Table {
        &self.table
    }
}

/// Rejects unknown keys and values of the wrong type, naming where they are.
fn check(
    schema: &Schema,
    keys: &[Key],
    table: &toml::Table,
    prefix: &str,
    origin_of: &dyn Fn(&str) -> Origin,
) -> Result<(), ConfigError> {
    for (name, value) in table {
        let path = join(prefix, name);
        let Some(key) = keys.iter().find(|k| k.name == name) else {
            let fix = match suggest(keys, name) {
                Some(near) => format!(
                    "did you mean {near}? Otherwise remove it (`{} init` lists every key)",
                    schema.program()
                ),
                None => format!("remove it (`{} init` lists every key)", schema.program()),
            };
            return Err(ConfigError::new(
                &path,
                origin_of(&path),
                format!("unknown key for {}", schema.program()),
                fix,
            ));
        };
        if !key.kind.matches(value) {
            return Err(ConfigError::new(
                &path,
                origin_of(&path),
                format!(
                    "expected {}, found {}",
                    key.kind.expected(),
                    value.type_str()
                ),
                match key.default {
                    DefaultValue::Required { example }
                    | DefaultValue::Unset { example }
                    | DefaultValue::Value(example) => {
                        format!("write it like `{} = {example}`", key.name)
                    }
                },
            ));
        }
        match (key.kind, value) {
            (Kind::Table(children), toml::Value::Table(inner)) => {
                check(schema, children, inner, &path, origin_of)?;
            }
            (kind, toml::Value::Array(items)) if kind.is_list() => {
                for (i, item) in items.iter().enumerate() {
                    if let toml::Value::String(text) = item
                        && let Err((problem, fix)) = kind.check_element(text)
                    {
                        let element = format!("{path}[{i}]");
                        return Err(ConfigError::new(
                            &element,
                            origin_of(&element),
                            problem,
                            fix,
                        ));
                    }
                }
            }
            (Kind::TableArray(children), toml::Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    if let toml::Value::Table(inner) = item {
                        check(schema, children, inner, &format!("{path}[{i}]"), origin_of)?;
                    }
                }
            }
            (Kind::Map(children), toml::Value::Table(entries)) => {
                for (name, entry) in entries {
                    if let toml::Value::Table(inner) = entry {
                        check(schema, children, inner, &join(&path, name), origin_of)?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Makes relative `Path` values absolute against the config file's directory.
fn anchor_paths(keys: &[Key], table: &mut toml::Table, base: &Path) {
    for (name, value) in table.iter_mut() {
        let Some(key) = keys.iter().find(|k| k.name == name) else {
            continue;
        };
        match (key.kind, value) {
            (Kind::Path, toml::Value::String(s)) => {
                let p = Path::new(s.as_str());
                if p.is_relative() && !base.as_os_str().is_empty() {
                    *s = base.join(p).to_string_lossy().into_owned();
                }
            }
            (Kind::Table(children), toml::Value::Table(inner)) => {
                anchor_paths(children, inner, base)
            }
            (Kind::TableArray(children), toml::Value::Array(items)) => {
                for item in items {
                    if let toml::Value::Table(inner) = item {
                        anchor_paths(children, inner, base);
                    }
                }
            }
            (Kind::Map(children), toml::Value::Table(entries)) => {
                for (_, entry) in entries.iter_mut() {
                    if let toml::Value::Table(inner) = entry {
                        anchor_paths(children, inner, base);
                    }
                }
            }
            _ => {}
        }
    }
}

/// Byte offsets of every key and array element in a parsed document, by path.
fn record_positions(table: &toml_edit::Table, prefix: &str, out: &mut BTreeMap<String, usize>) {
    for (name, item) in table.iter() {
        let path = join(prefix, name);
        let start = table
            .key(name)
            .and_then(|k| k.span())
            .or_else(|| item.span())
            .map(|s| s.start);
        if let Some(start) = start {
            out.insert(path.clone(), start);
        }
        record_item(item, &path, out);
    }
}

fn record_item(item: &toml_edit::Item, path: &str, out: &mut BTreeMap<String, usize>) {
    match item {
        toml_edit::Item::Table(t) => record_positions(t, path, out),
        toml_edit::Item::ArrayOfTables(tables) => {
            for (i, t) in tables.iter().enumerate() {
                let p = format!("{path}[{i}]");
                if let Some(span) = t.span() {
                    out.insert(p.clone(), span.start);
                }
                record_positions(t, &p, out);
            }
        }
        toml_edit::Item::Value(toml_edit::Value::Array(array)) => {
            for (i, v) in array.iter().enumerate() {
                if let Some(span) = v.span() {
                    out.insert(format!("{path}[{i}]"), span.start);
                }
            }
        }
        toml_edit::Item::Value(toml_edit::Value::InlineTable(t)) => {
            for (name, v) in t.iter() {
                let p = join(path, name);
                if let Some(span) = t.key(name).and_then(|k| k.span()).or_else(|| v.span()) {
                    out.insert(p.clone(), span.start);
                }
            }
        }
        _ => {}
    }
}

fn collect_paths(value: &toml::Value, prefix: &str, visit: &mut dyn FnMut(&str)) {
    match value {
        toml::Value::Table(table) => {
            for (name, v) in table {
                let path = join(prefix, name);
                visit(&path);
                collect_paths(v, &path, visit);
            }
        }
        toml::Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                let path = format!("{prefix}[{i}]");
                visit(&path);
                collect_paths(v, &path, visit);
            }
        }
        _ => {}
    }
}

fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Sets a dotted path in a table, creating intermediate tables.
fn set(table: &mut toml::Table, path: &str, value: toml::Value) {
    let mut parts: Vec<&str> = path.split('.').collect();
    let Some(last) = parts.pop() else { return };
    let mut current = table;
    for part in parts {
        let entry = current
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if !entry.is_table() {
            *entry = toml::Value::Table(toml::Table::new());
        }
        let toml::Value::Table(next) = entry else {
            return;
        };
        current = next;
    }
    current.insert(last.to_string(), value);
}

fn parse_literal(literal: &str) -> Result<toml::Value, String> {
    let table: toml::Table =
        toml::from_str(&format!("v = {literal}")).map_err(|e| e.message().to_string())?;
    table.get("v").cloned().ok_or_else(|| "empty".to_string())
}

/// The known key closest to `name`, if one is close enough to be a likely typo.
/// The dotted path of a setting (at any depth) closest to `path`, if one is close.
fn closest_path(keys: &[Key], path: &str) -> Option<String> {
    fn all(keys: &[Key], prefix: &str, out: &mut Vec<String>) {
        for key in keys {
            let path = join(prefix, key.name);
            if let Kind::Table(children) = key.kind {
                all(children, &path, out);
            }
            out.push(path);
        }
    }
    let mut paths = Vec::new();
    all(keys, "", &mut paths);
    paths
        .into_iter()
        .map(|p| (distance(&p, path), p))
        .filter(|(d, p)| *d <= 2.max(p.len() / 4))
        .min()
        .map(|(_, p)| p)
}

fn suggest(keys: &[Key], name: &str) -> Option<&'static str> {
    keys.iter()
        .map(|k| (distance(k.name, name), k.name))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min()
        .map(|(_, k)| k)
}

fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            current.push(
                (previous[j] + cost)
                    .min(previous[j + 1] + 1)
                    .min(current[j] + 1),
            );
        }
        previous = current;
    }
    previous[b.len()]
}
