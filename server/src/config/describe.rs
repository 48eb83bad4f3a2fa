//! How the tables of the config file describe their keys.
//!
//! Each table is declared once, with [`table!`], as the struct serde reads,
//! and its keys (for the loader's check, `guardmesh config check` and
//! `guardmesh config reference`, see [`super::keys`]) are read from that
//! declaration:
//!
//! - the key's name: the field's, or its `#[serde(rename)]`; a field that is
//!   `#[serde(skip)]` is no key;
//! - its meaning: the field's doc comment, its lines joined;
//! - its type: the field's Rust type ([`Value`]);
//! - whether it is required: a field that is not an `Option` and has no
//!   serde default, neither its own nor its table's;
//! - its default: the value serde fills in when the key is left out, read
//!   from the table as serde reads it with its required keys only. A field
//!   with a `skip_serializing_if` (an empty value is the same as none) shows
//!   none.

use super::keys::Kind;
use serde::de::DeserializeOwned;
use std::fmt::Write as _;

/// Declares a table of the config file: the struct exactly as written, and
/// its keys ([`Table`]) read from the declaration, as the module says. The
/// struct's attributes are its doc comment, one `#[derive]` and one
/// `#[serde]`, in that order; each field's are its doc comment, then its
/// `#[serde]` attributes.
macro_rules! table {
    (
        $(#[doc = $table_doc:literal])*
        #[derive($($derive:tt)*)]
        #[serde($($container:tt)*)]
        pub struct $name:ident {
            $(
                $(#[doc = $doc:literal])*
                $(#[serde($($attr:tt)*)])*
                pub $field:ident: $ty:ty,
            )*
        }
    ) => {
        $(#[doc = $table_doc])*
        #[derive($($derive)*)]
        #[serde($($container)*)]
        pub struct $name {
            $(
                $(#[doc = $doc])*
                $(#[serde($($attr)*)])*
                pub $field: $ty,
            )*
        }

        impl $crate::config::describe::Table for $name {
            fn keys() -> Vec<$crate::config::describe::Field> {
                use $crate::config::describe::{Field, Value};
                let container = stringify!($($container)*);
                let fields = vec![$(
                    Field::declared(
                        stringify!($field),
                        &[$($doc),*],
                        stringify!($($($attr)*),*),
                        container,
                        <$ty as Value>::kind(),
                        <$ty as Value>::OPTIONAL,
                        <$ty as Value>::KEYS,
                    )
                ),*];
                let left_out: Self = $crate::config::describe::left_out(&fields);
                $crate::config::describe::with_defaults(
                    fields,
                    [$(Value::toml(&left_out.$field)),*],
                )
            }
        }

        impl $crate::config::describe::Value for $name {
            const KEYS: Option<fn() -> Vec<$crate::config::describe::Field>> =
                Some(<Self as $crate::config::describe::Table>::keys);

            fn kind() -> $crate::config::keys::Kind {
                $crate::config::keys::Kind::Table
            }

            fn toml(&self) -> Option<String> {
                None
            }
        }
    };
}
pub(super) use table;

/// A table of the config file, declared with [`table!`].
pub(crate) trait Table: DeserializeOwned {
    /// Its keys, in declaration order.
    fn keys() -> Vec<Field>;
}

/// One key of a table, as its declaration says.
#[derive(Debug)]
pub(crate) struct Field {
    pub(crate) name: &'static str,
    pub(crate) meaning: String,
    pub(crate) kind: Kind,
    pub(crate) required: bool,
    /// The value when the key is left out, as TOML; `None`: unset (or a
    /// table, or required).
    pub(crate) default: Option<String>,
    /// The keys of the table it is, or of each entry of its list of tables.
    pub(crate) keys: Option<fn() -> Vec<Field>>,
    /// `#[serde(skip)]`: not read from the file.
    skip: bool,
    /// `skip_serializing_if`: its default is shown as unset.
    unset: bool,
}

impl Field {
    /// A field as [`table!`] reads it: its name, doc comment lines, serde
    /// attributes and its table's, and what its type says.
    pub(crate) fn declared(
        field: &'static str,
        doc: &[&str],
        attrs: &'static str,
        container: &'static str,
        kind: Kind,
        optional: bool,
        keys: Option<fn() -> Vec<Field>>,
    ) -> Self {
        let attrs = SerdeAttrs::read(attrs);
        let meaning = doc
            .iter()
            .map(|line| line.trim())
            .filter(|line| !line.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        Field {
            name: attrs.rename.unwrap_or(field),
            meaning,
            kind,
            required: !optional && !attrs.default && !SerdeAttrs::read(container).default,
            default: None,
            keys,
            skip: attrs.skip,
            unset: attrs.skip_serializing_if,
        }
    }
}

/// What [`Field::declared`] reads in `#[serde(...)]` attributes.
#[derive(Default)]
struct SerdeAttrs {
    default: bool,
    skip: bool,
    skip_serializing_if: bool,
    rename: Option<&'static str>,
}

impl SerdeAttrs {
    /// Reads the attributes' arguments as `stringify!` writes them:
    /// `default, rename = "guard"`.
    fn read(text: &'static str) -> Self {
        let mut attrs = Self::default();
        for item in text.split(',') {
            let (name, value) = match item.split_once('=') {
                Some((name, value)) => (name.trim(), Some(value.trim().trim_matches('"'))),
                None => (item.trim(), None),
            };
            match name {
                "default" => attrs.default = true,
                "skip" => attrs.skip = true,
                "skip_serializing_if" => attrs.skip_serializing_if = true,
                "rename" => attrs.rename = value,
                _ => {}
            }
        }
        attrs
    }
}

/// The table `T` as serde reads it with its required keys only (each set to
/// a value of its type): every other field holds its default.
pub(crate) fn left_out<T: DeserializeOwned>(fields: &[Field]) -> T {
    let mut text = String::new();
    for field in fields.iter().filter(|f| f.required) {
        let _ = writeln!(text, "{} = {}", field.name, placeholder(field.kind));
    }
    toml::from_str(&text).unwrap_or_else(|error| {
        panic!("a config table with its required keys only ({text:?}) is refused: {error}")
    })
}

/// A value of type `kind`, for a required key.
fn placeholder(kind: Kind) -> String {
    match kind {
        Kind::Bool => "true".into(),
        Kind::Int => "1".into(),
        Kind::Str | Kind::Path => "\"x\"".into(),
        Kind::Addr => "\"127.0.0.1:1\"".into(),
        Kind::Enum(names) => format!("\"{}\"", names[0]),
        Kind::Names(names) => format!("[\"{}\"]", names[0]),
        Kind::Strs | Kind::Tables => "[]".into(),
        Kind::Table => "{}".into(),
    }
}

/// The fields with their defaults (as [`left_out`] read them), the skipped
/// ones left out.
pub(crate) fn with_defaults(
    fields: Vec<Field>,
    defaults: impl IntoIterator<Item = Option<String>>,
) -> Vec<Field> {
    fields
        .into_iter()
        .zip(defaults)
        .filter(|(field, _)| !field.skip)
        .map(|(mut field, default)| {
            if !field.required && !field.unset {
                field.default = default;
            }
            field
        })
        .collect()
}

/// The type of a key's value, and how the reference writes a value of it.
pub(crate) trait Value {
    /// An `Option`: leaving the key out is allowed without a default.
    const OPTIONAL: bool = false;
    /// The keys of a table (or of each entry of a list of tables).
    const KEYS: Option<fn() -> Vec<Field>> = None;

    /// The key's type.
    fn kind() -> Kind;

    /// The value as TOML; `None`: unset, or a table.
    fn toml(&self) -> Option<String>;
}

macro_rules! integers {
    ($($ty:ty),*) => {$(
        impl Value for $ty {
            fn kind() -> Kind {
                Kind::Int
            }

            fn toml(&self) -> Option<String> {
                Some(self.to_string())
            }
        }
    )*};
}
integers!(u32, u64, usize, i32);

impl Value for bool {
    fn kind() -> Kind {
        Kind::Bool
    }

    fn toml(&self) -> Option<String> {
        Some(self.to_string())
    }
}

impl Value for String {
    fn kind() -> Kind {
        Kind::Str
    }

    fn toml(&self) -> Option<String> {
        Some(quote(self))
    }
}

impl Value for std::path::PathBuf {
    fn kind() -> Kind {
        Kind::Path
    }

    fn toml(&self) -> Option<String> {
        Some(quote(&self.to_string_lossy()))
    }
}

impl Value for std::net::SocketAddr {
    fn kind() -> Kind {
        Kind::Addr
    }

    fn toml(&self) -> Option<String> {
        Some(quote(&self.to_string()))
    }
}

impl<T: Value> Value for Option<T> {
    const OPTIONAL: bool = true;
    const KEYS: Option<fn() -> Vec<Field>> = T::KEYS;

    fn kind() -> Kind {
        T::kind()
    }

    fn toml(&self) -> Option<String> {
        self.as_ref().and_then(T::toml)
    }
}

impl<T: Value> Value for Vec<T> {
    const KEYS: Option<fn() -> Vec<Field>> = T::KEYS;

    fn kind() -> Kind {
        match T::kind() {
            Kind::Str => Kind::Strs,
            Kind::Enum(names) => Kind::Names(names),
            Kind::Table => Kind::Tables,
            other => unreachable!("no key of the config is a list of {other:?}"),
        }
    }

    fn toml(&self) -> Option<String> {
        if T::KEYS.is_some() {
            return None;
        }
        let items: Option<Vec<String>> = self.iter().map(T::toml).collect();
        Some(format!("[{}]", items?.join(", ")))
    }
}

/// The enums of the contract, read by their one spelling (`by_name`).
macro_rules! named {
    ($($ty:ty),*) => {$(
        impl Value for $ty {
            fn kind() -> Kind {
                Kind::Enum(<$ty>::NAMES)
            }

            fn toml(&self) -> Option<String> {
                Some(quote(self.name()))
            }
        }
    )*};
}
named!(
    guardmesh_proto::v1::GuardRole,
    guardmesh_proto::v1::FailurePolicy,
    guardmesh_proto::v1::AskFallback,
    guardmesh_proto::v1::GuardMode,
    guardmesh_proto::v1::GuardPhases,
    guardmesh_proto::v1::SessionMemoryUse
);

/// The mesh's own enums, read by serde: their names are the ones serde
/// reads.
macro_rules! serde_enums {
    ($($ty:ty),*) => {$(
        impl Value for $ty {
            fn kind() -> Kind {
                Kind::Enum(variants::<$ty>())
            }

            fn toml(&self) -> Option<String> {
                variant_name(self).map(quote)
            }
        }
    )*};
}
serde_enums!(
    crate::mesh::Unguarded,
    crate::security::auth::Role,
    crate::registry::etcd::AfterWindow,
    crate::decision_log::OnLogFailure,
    super::RegistryKind,
    super::SessionStoreKind,
    super::DurabilityConfig
);

/// The names of `T`'s variants as serde reads them: what its derived
/// `Deserialize` hands to `deserialize_enum`.
fn variants<T: DeserializeOwned>() -> &'static [&'static str] {
    use serde::de::Visitor;

    /// A deserializer that only answers with the variants it is asked for.
    struct Probe;

    #[derive(Debug)]
    struct Variants(&'static [&'static str]);

    impl std::fmt::Display for Variants {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "variants {:?}", self.0)
        }
    }

    impl std::error::Error for Variants {}

    impl serde::de::Error for Variants {
        fn custom<M: std::fmt::Display>(_: M) -> Self {
            Variants(&[])
        }
    }

    impl<'de> serde::Deserializer<'de> for Probe {
        type Error = Variants;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Variants> {
            Err(Variants(&[]))
        }

        fn deserialize_enum<V: Visitor<'de>>(
            self,
            _: &'static str,
            variants: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Variants> {
            Err(Variants(variants))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map struct identifier ignored_any
        }
    }

    match T::deserialize(Probe) {
        Err(Variants(names)) => names,
        Ok(_) => &[],
    }
}

/// The name serde reads as `value`.
fn variant_name<T: DeserializeOwned + PartialEq>(value: &T) -> Option<&'static str> {
    use serde::de::IntoDeserializer;
    variants::<T>().iter().copied().find(|name| {
        let read: Result<T, serde::de::value::Error> = T::deserialize(name.into_deserializer());
        read.is_ok_and(|read| read == *value)
    })
}

/// `text` as a TOML basic string.
fn quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_attributes_are_read_as_stringify_writes_them() {
        let attrs = SerdeAttrs::read(r#"default, rename = "guard""#);
        assert!(attrs.default && !attrs.skip);
        assert_eq!(attrs.rename, Some("guard"));
        let attrs = SerdeAttrs::read(r#"default = "default_max_file_bytes""#);
        assert!(attrs.default && attrs.rename.is_none());
        let attrs = SerdeAttrs::read("deny_unknown_fields");
        assert!(!attrs.default);
        assert!(SerdeAttrs::read("skip").skip);
        let attrs = SerdeAttrs::read(r#"default, skip_serializing_if = "String::is_empty""#);
        assert!(attrs.default && attrs.skip_serializing_if && !attrs.skip);
    }

    #[test]
    fn enum_names_and_defaults_are_the_ones_serde_reads() {
        assert_eq!(
            variants::<crate::mesh::Unguarded>(),
            ["proceed", "cancel"].as_slice()
        );
        assert_eq!(
            crate::registry::etcd::AfterWindow::ServeStale.toml(),
            Some("\"serve_stale\"".into())
        );
        assert_eq!(
            vec!["a\"b".to_owned(), "c".to_owned()].toml(),
            Some(r#"["a\"b", "c"]"#.into())
        );
        assert_eq!(None::<u64>.toml(), None);
    }
}
