use std::fmt::Write;

/// What type of value a key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    String,
    /// A file or directory; relative paths in a config file are relative to that file.
    Path,
    Integer,
    Float,
    Bool,
    /// A list of strings (in the environment: a TOML array or a comma-separated list).
    StringList,
    /// A list of libp2p multiaddrs (`/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW…`).
    Multiaddrs,
    /// A list of IP ranges in CIDR notation (`10.0.0.0/8`).
    Cidrs,
    /// A table of further keys (`[resources]`).
    Table(&'static [Key]),
    /// An array of tables (`[[executors]]`).
    TableArray(&'static [Key]),
    /// Tables under names the user chooses, each holding these keys
    /// (`[artifacts.profiles.models]`, `[artifacts.profiles.datasets]`).
    Map(&'static [Key]),
    /// Strings under names the user chooses (`options = { region = "eu-west-1" }`).
    StringMap,
}

/// What any entry of a [`Kind::StringMap`] is.
static STRING_ENTRY: Key = Key {
    name: "*",
    kind: Kind::String,
    default: DefaultValue::Unset {
        example: r#""value""#,
    },
    doc: "",
};

impl Kind {
    fn describe(self) -> &'static str {
        match self {
            Kind::String => "a string",
            Kind::Path => "a path (string)",
            Kind::Integer => "an integer",
            Kind::Float => "a number",
            Kind::Bool => "true or false",
            Kind::StringList => "a list of strings",
            Kind::Multiaddrs => "a list of multiaddrs",
            Kind::Cidrs => "a list of CIDR ranges",
            Kind::Table(_) => "a table",
            Kind::TableArray(_) => "an array of tables",
            Kind::Map(_) => "a table of named tables",
            Kind::StringMap => "a table of strings",
        }
    }

    pub(crate) fn matches(self, value: &toml::Value) -> bool {
        match (self, value) {
            (Kind::String | Kind::Path, toml::Value::String(_)) => true,
            (Kind::Integer, toml::Value::Integer(_)) => true,
            (Kind::Float, toml::Value::Float(_) | toml::Value::Integer(_)) => true,
            (Kind::Bool, toml::Value::Boolean(_)) => true,
            (Kind::StringList | Kind::Multiaddrs | Kind::Cidrs, toml::Value::Array(items)) => {
                items.iter().all(|i| matches!(i, toml::Value::String(_)))
            }
            (Kind::Table(_), toml::Value::Table(_)) => true,
            (Kind::TableArray(_), toml::Value::Array(items)) => {
                items.iter().all(|i| matches!(i, toml::Value::Table(_)))
            }
            (Kind::Map(_), toml::Value::Table(entries)) => {
                entries.values().all(|e| matches!(e, toml::Value::Table(_)))
            }
            (Kind::StringMap, toml::Value::Table(entries)) => entries
                .values()
                .all(|e| matches!(e, toml::Value::String(_))),
            _ => false,
        }
    }

    pub(crate) fn expected(self) -> &'static str {
        self.describe()
    }

    /// Whether this kind is a list of strings (and so takes comma-separated overrides).
    pub(crate) fn is_list(self) -> bool {
        matches!(self, Kind::StringList | Kind::Multiaddrs | Kind::Cidrs)
    }

    /// Checks one element of a list kind; on failure, what is wrong and how to write it.
    pub(crate) fn check_element(self, text: &str) -> Result<(), (String, &'static str)> {
        match self {
            Kind::Multiaddrs => text.parse::<libp2p::Multiaddr>().map(|_| ()).map_err(|e| {
                (
                    format!("{text:?} is not a multiaddr ({e})"),
                    "write it like \"/ip4/203.0.113.7/tcp/4001\" (gateways: append /p2p/<peer id>)",
                )
            }),
            Kind::Cidrs => text.parse::<ipnet::IpNet>().map(|_| ()).map_err(|e| {
                (
                    format!("{text:?} is not a CIDR range ({e})"),
                    "write it like \"10.0.0.0/8\" or \"fc00::/7\"",
                )
            }),
            _ => Ok(()),
        }
    }
}

/// A key's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultValue {
    /// The key must be set; the example is what `init` writes.
    Required { example: &'static str },
    /// The default value, as a TOML literal.
    Value(&'static str),
    /// Absent unless set; the example is what `init` writes, commented out.
    Unset { example: &'static str },
}

/// One config key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub name: &'static str,
    pub kind: Kind,
    pub default: DefaultValue,
    /// One or more sentences; `init` writes them as comments above the key.
    pub doc: &'static str,
}

/// Every key a node program accepts.
#[derive(Debug, Clone)]
pub struct Schema {
    program: &'static str,
    keys: Vec<Key>,
}

impl Schema {
    /// A schema for `program` (used in messages, such as "hypha-gateway has no key …").
    pub fn new(program: &'static str, keys: Vec<Key>) -> Self {
        Schema { program, keys }
    }

    pub fn program(&self) -> &'static str {
        self.program
    }

    pub fn keys(&self) -> &[Key] {
        &self.keys
    }

    /// Finds a key by dotted path (`resources.cpu`, `artifacts.profiles.models.url`: entries
    /// of a map take any name); array indices are not part of paths here.
    pub(crate) fn find(&self, path: &[&str]) -> Option<&Key> {
        let (first, mut rest) = path.split_first()?;
        let mut key = self.keys.iter().find(|k| k.name == *first)?;
        while let Some((part, tail)) = rest.split_first() {
            (key, rest) = match key.kind {
                Kind::Table(children) | Kind::TableArray(children) => {
                    (children.iter().find(|k| k.name == *part)?, tail)
                }
                Kind::Map(children) => {
                    let (field, tail) = tail.split_first()?;
                    (children.iter().find(|k| k.name == *field)?, tail)
                }
                Kind::StringMap => (&STRING_ENTRY, tail),
                _ => return None,
            };
        }
        Some(key)
    }

    /// A commented TOML file holding every key with its default (optional keys commented out).
    pub fn template(&self) -> String {
        let mut out = format!(
            "# {} configuration.\n#\n# Every key is listed with its default. Settings can be overridden by\n# HYPHA_<KEY> environment variables (nested keys joined with __, e.g.\n# HYPHA_RESOURCES__CPU) and by command-line flags, in that order of precedence.\n",
            self.program
        );
        let (scalars, tables): (Vec<&Key>, Vec<&Key>) = self
            .keys
            .iter()
            .partition(|k| !matches!(k.kind, Kind::Table(_) | Kind::TableArray(_) | Kind::Map(_)));
        for key in scalars {
            write_key(&mut out, key);
        }
        for key in tables {
            out.push('\n');
            write_doc(&mut out, key.doc);
            match key.kind {
                Kind::Table(children) => {
                    let _ = writeln!(out, "[{}]", key.name);
                    for child in children {
                        match child.kind {
                            Kind::Map(entry) => {
                                out.push('\n');
                                write_doc(&mut out, child.doc);
                                write_map(&mut out, &format!("{}.{}", key.name, child.name), entry);
                            }
                            _ => write_key(&mut out, child),
                        }
                    }
                }
                Kind::Map(entry) => write_map(&mut out, key.name, entry),
                Kind::TableArray(children) => {
                    let _ = writeln!(out, "[[{}]]", key.name);
                    for child in children {
                        write_key(&mut out, child);
                    }
                }
                _ => {}
            }
        }
        out
    }
}

fn write_doc(out: &mut String, doc: &str) {
    for line in wrap(doc, 96) {
        let _ = writeln!(out, "# {line}");
    }
}

/// A map's entries take names the user chooses: shown as one commented example entry.
fn write_map(out: &mut String, path: &str, entry: &[Key]) {
    let _ = writeln!(out, "# [{path}.NAME]");
    for key in entry {
        for line in wrap(key.doc, 94) {
            let _ = writeln!(out, "#   {line}");
        }
        let (example, note) = match key.default {
            DefaultValue::Required { example } => (example, " (required)"),
            DefaultValue::Value(value) => (value, ""),
            DefaultValue::Unset { example } => (example, " (optional)"),
        };
        let _ = writeln!(out, "# {} = {example}{note}", key.name);
    }
}

fn write_key(out: &mut String, key: &Key) {
    out.push('\n');
    write_doc(out, key.doc);
    match key.default {
        DefaultValue::Required { example } => {
            let _ = writeln!(out, "# Required.");
            let _ = writeln!(out, "{} = {example}", key.name);
        }
        DefaultValue::Value(value) => {
            let _ = writeln!(out, "{} = {value}", key.name);
        }
        DefaultValue::Unset { example } => {
            let _ = writeln!(out, "# {} = {example}", key.name);
        }
    }
}

fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}
