//! Enums whose values are names on the wire (attribute values, condition elements).

/// Declares an enum whose variants are wire names: `as_str` and `parse` come from the same
/// row, so the two can never disagree. The enum's visibility is also its methods'.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$doc:meta])* $variant:ident => $wire:literal,)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {
            $($(#[$doc])* $variant,)*
        }

        impl $name {
            /// Every value, in the order the RFC lists them (some enums walk it only in
            /// their tests).
            #[allow(dead_code)]
            $vis const ALL: &'static [$name] = &[$($name::$variant),*];

            /// The name on the wire.
            $vis fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $wire,)*
                }
            }

            /// The value a wire name stands for; `None` for a name the RFC does not define.
            $vis fn parse(s: &str) -> Option<Self> {
                match s {
                    $($wire => Some($name::$variant),)*
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
