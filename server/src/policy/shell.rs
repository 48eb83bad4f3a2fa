//! The `shell` helpers rules may call on a command line an agent sent:
//!
//! * `shell.commands(cmd)`: the words of each simple command of `cmd`, a
//!   list of lists of strings, split as a POSIX shell splits them (quotes,
//!   backslashes, comments), on `;`, `&`, `&&`, `|`, `||`, new lines,
//!   `( )`, `$( )` and backquotes; redirections and their targets left out;
//! * `shell.has_flags(cmd, program, flags)`: whether some simple command of
//!   `cmd` runs `program` with every flag of `flags`, in any grouping and
//!   order (`-rf`, `-fr`, `-r -f`, `--recursive --force`).
//!
//! `shell.has_flags` also reads the command line of `sh -c '...'` and the
//! words of `eval`, up to [`MAX_NESTING`] deep (deeper is an error).
//! Both read text, not a shell: variables, globs and aliases are not
//! expanded. They read
//! to catch a command, not to run one, so where a shell would refuse the
//! text they still read it: an unterminated quote runs to the end, and a
//! `$(` or backquote inside double quotes starts a command of its own.
//!
//! Their work is linear in the bytes of `cmd` (times the nesting), which the meter charged when
//! the rule read it, and no recursion follows the nesting of quotes. The
//! lists `shell.commands` builds are bounded: a command over
//! [`MAX_SPLIT_BYTES`] is an error of the rule (R13 then applies, never a
//! proceed); `shell.has_flags` reads any length, so padding a command
//! cannot turn its answer into an error.

use cel::common::types::{self, CelBool, CelList, CelString};
use cel::common::value::{CowVal, Val};
use cel::{Env, ExecutionError};

/// Bytes of a command `shell.commands` splits into lists.
pub(crate) const MAX_SPLIT_BYTES: usize = 64 << 10;

/// Words that may come before the program of a simple command.
const KEYWORDS: [&str; 10] = [
    "!", "{", "}", "if", "then", "else", "elif", "while", "until", "do",
];

/// Programs that run another program named later in their arguments. Behind
/// one of them, any later word naming the program counts (their options,
/// and which take a value, differ from one to the other).
const WRAPPERS: [&str; 15] = [
    "sudo", "doas", "env", "command", "exec", "builtin", "nice", "nohup", "time", "timeout",
    "xargs", "busybox", "stdbuf", "ionice", "setsid",
];

/// Other spellings of a flag, by program: (program, flag, the same flag).
const ALIASES: [(&str, &str, &[&str]); 11] = [
    ("rm", "r", &["R", "recursive"]),
    ("rm", "R", &["r", "recursive"]),
    ("rm", "f", &["force"]),
    ("rm", "i", &["interactive"]),
    ("rm", "d", &["dir"]),
    ("rm", "v", &["verbose"]),
    ("cp", "r", &["R", "recursive"]),
    ("cp", "R", &["r", "recursive"]),
    ("chmod", "R", &["recursive"]),
    ("chown", "R", &["recursive"]),
    ("chgrp", "R", &["recursive"]),
];

/// How a quote is open.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Quote {
    None,
    Single,
    Double,
}

/// The simple commands of `text`, each its words.
pub(crate) fn split(text: &str) -> Vec<Vec<String>> {
    let mut commands = Vec::new();
    let mut words: Vec<String> = Vec::new();
    // The word being read: `Some("")` once a quote opened it.
    let mut word: Option<String> = None;
    // The next word is the target of a redirection.
    let mut redirect = false;
    let mut quote = Quote::None;
    let mut chars = text.chars().peekable();
    let end_word = |word: &mut Option<String>, words: &mut Vec<String>, redirect: &mut bool| {
        if let Some(w) = word.take() {
            if *redirect {
                *redirect = false;
            } else {
                words.push(w);
            }
        }
    };
    let end_command = |words: &mut Vec<String>, commands: &mut Vec<Vec<String>>| {
        if !words.is_empty() {
            commands.push(std::mem::take(words));
        }
    };
    while let Some(c) = chars.next() {
        match quote {
            Quote::Single => {
                if c == '\'' {
                    quote = Quote::None;
                } else {
                    word.get_or_insert_with(String::new).push(c);
                }
            }
            Quote::Double => match c {
                '"' => quote = Quote::None,
                '\\' => match chars.next() {
                    Some('\n') => {}
                    Some(next @ ('$' | '`' | '"' | '\\')) => {
                        word.get_or_insert_with(String::new).push(next);
                    }
                    Some(next) => {
                        let w = word.get_or_insert_with(String::new);
                        w.push('\\');
                        w.push(next);
                    }
                    None => word.get_or_insert_with(String::new).push('\\'),
                },
                // A command substitution runs even inside double quotes:
                // read as a command of its own.
                '`' | '$' if c == '`' || chars.peek() == Some(&'(') => {
                    if c == '$' {
                        chars.next();
                    }
                    quote = Quote::None;
                    end_word(&mut word, &mut words, &mut redirect);
                    end_command(&mut words, &mut commands);
                }
                _ => word.get_or_insert_with(String::new).push(c),
            },
            Quote::None => match c {
                '\'' => {
                    quote = Quote::Single;
                    word.get_or_insert_with(String::new);
                }
                '"' => {
                    quote = Quote::Double;
                    word.get_or_insert_with(String::new);
                }
                '\\' => match chars.next() {
                    Some('\n') => {}
                    Some(next) => word.get_or_insert_with(String::new).push(next),
                    None => word.get_or_insert_with(String::new).push('\\'),
                },
                ' ' | '\t' | '\r' => end_word(&mut word, &mut words, &mut redirect),
                '#' if word.is_none() => {
                    for skipped in chars.by_ref() {
                        if skipped == '\n' {
                            break;
                        }
                    }
                    end_command(&mut words, &mut commands);
                }
                '<' | '>' => {
                    // `2>`: the digits name a file descriptor, not a word.
                    if word
                        .as_deref()
                        .is_some_and(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit()))
                    {
                        word = None;
                    }
                    end_word(&mut word, &mut words, &mut redirect);
                    while chars
                        .peek()
                        .is_some_and(|n| matches!(n, '<' | '>' | '&' | '|'))
                    {
                        chars.next();
                    }
                    redirect = true;
                }
                '$' if chars.peek() == Some(&'(') => {
                    chars.next();
                    end_word(&mut word, &mut words, &mut redirect);
                    end_command(&mut words, &mut commands);
                }
                ';' | '&' | '|' | '\n' | '(' | ')' | '`' => {
                    end_word(&mut word, &mut words, &mut redirect);
                    redirect = false;
                    end_command(&mut words, &mut commands);
                }
                _ => word.get_or_insert_with(String::new).push(c),
            },
        }
    }
    end_word(&mut word, &mut words, &mut redirect);
    end_command(&mut words, &mut commands);
    commands
}

/// The last part of a path: `rm` of `/bin/rm`.
fn base(word: &str) -> &str {
    word.rsplit('/').next().unwrap_or(word)
}

/// A variable assignment before a command: `NAME=value`.
fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        let mut chars = name.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// Where the command itself begins in `words`: after the shell's keywords
/// and the variable assignments before it.
fn command_word(words: &[String]) -> usize {
    words
        .iter()
        .take_while(|w| KEYWORDS.contains(&w.as_str()) || is_assignment(w))
        .count()
}

/// The arguments each run of `program` in `words` has (a simple command
/// may name it after a wrapper: `sudo -u root rm`).
fn runs<'w>(words: &'w [String], program: &str) -> Vec<&'w [String]> {
    let at = command_word(words);
    let Some(first) = words.get(at) else {
        return Vec::new();
    };
    if base(first) == program {
        return vec![&words[at + 1..]];
    }
    if !WRAPPERS.contains(&base(first)) {
        return Vec::new();
    }
    (at + 1..words.len())
        .filter(|&i| base(&words[i]) == program)
        .map(|i| &words[i + 1..])
        .collect()
}

/// Whether `words` run `program` with a flag of each of `spellings`.
/// Behind a wrapper, any later word naming the program counts, with the
/// flags after it up to a `--`: read in one pass from the end, so that a
/// command naming the program many times is still read once.
fn runs_with(words: &[String], program: &str, spellings: &[Vec<&str>]) -> bool {
    let at = command_word(words);
    let Some(first) = words.get(at) else {
        return false;
    };
    if base(first) == program {
        return spellings.iter().all(|s| has_flag(&words[at + 1..], s));
    }
    if !WRAPPERS.contains(&base(first)) {
        return false;
    }
    let mut seen = vec![false; spellings.len()];
    for word in words[at + 1..].iter().rev() {
        if word == "--" {
            seen.fill(false);
            continue;
        }
        if base(word) == program && seen.iter().all(|s| *s) {
            return true;
        }
        for (seen, s) in seen.iter_mut().zip(spellings) {
            *seen |= has_flag(std::slice::from_ref(word), s);
        }
    }
    false
}

/// One flag asked for: its spellings, short (one character) or long,
/// with the others the program takes for it (`-R`, `--recursive` for `rm`'s
/// `-r`, and `-r` for its `--recursive`).
fn spellings<'a>(program: &str, flag: &'a str) -> Vec<&'a str> {
    let flag = flag.trim_start_matches('-');
    let mut all = vec![flag];
    for (_, f, more) in ALIASES
        .iter()
        .filter(|(p, f, more)| *p == program && (*f == flag || more.contains(&flag)))
    {
        all.push(f);
        all.extend(more.iter().copied());
    }
    all
}

/// Whether `args` hold a flag spelt as one of `spellings`, before any `--`.
fn has_flag(args: &[String], spellings: &[&str]) -> bool {
    for arg in args {
        if arg == "--" {
            return false;
        }
        if let Some(long) = arg.strip_prefix("--") {
            let name = long.split_once('=').map_or(long, |(name, _)| name);
            // GNU programs take any unambiguous prefix: `--rec`.
            if !name.is_empty()
                && spellings
                    .iter()
                    .any(|s| s.chars().count() > 1 && s.starts_with(name))
            {
                return true;
            }
        } else if let Some(short) = arg.strip_prefix('-')
            && short
                .chars()
                .any(|c| spellings.iter().any(|s| s.chars().eq(std::iter::once(c))))
        {
            return true;
        }
    }
    false
}

/// How deeply `sh -c '...'` and `eval` are read into.
pub(crate) const MAX_NESTING: usize = 8;

/// Shells whose `-c` runs their next word as a command line.
const SHELLS: [&str; 6] = ["sh", "bash", "dash", "zsh", "ksh", "ash"];

/// Whether some simple command of `text` runs `program` (compared by the
/// last part of its path) with every one of `flags`, also inside the
/// command line of `sh -c '...'` or `eval`. Commands nested deeper than
/// [`MAX_NESTING`] are an error, not a guess.
pub(crate) fn has_flags(text: &str, program: &str, flags: &[&str]) -> Result<bool, String> {
    let program = base(program);
    let spellings: Vec<Vec<&str>> = flags.iter().map(|f| spellings(program, f)).collect();
    has_flags_within(text, program, &spellings, 0)
}

fn has_flags_within(
    text: &str,
    program: &str,
    spellings: &[Vec<&str>],
    depth: usize,
) -> Result<bool, String> {
    for words in split(text) {
        if runs_with(&words, program, spellings) {
            return Ok(true);
        }
        for inner in nested(&words) {
            if depth + 1 > MAX_NESTING {
                return Err(format!(
                    "the command nests `sh -c` or `eval` more than {MAX_NESTING} deep"
                ));
            }
            if has_flags_within(&inner, program, spellings, depth + 1)? {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// The command lines a simple command runs in turn: the word after `-c`
/// of a shell (`bash -c '...'`, `sh -ec '...'`), the words of `eval`.
fn nested(words: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    for shell in SHELLS {
        for args in runs(words, shell) {
            let mut after_c = false;
            for arg in args {
                if arg == "--" {
                    continue;
                }
                if let Some(short) = arg.strip_prefix('-')
                    && !short.starts_with('-')
                {
                    after_c |= short.contains('c');
                    continue;
                }
                if after_c {
                    found.push(arg.clone());
                }
                break;
            }
        }
    }
    // The first `eval` only: its words hold any later one.
    if let Some(args) = runs(words, "eval").first() {
        found.push(args.join(" "));
    }
    found
}

/// The string argument `i` of a call of `name`.
fn string_arg<'x>(
    name: &str,
    args: &'x [CowVal<'_, '_>],
    i: usize,
) -> Result<&'x str, ExecutionError> {
    args.get(i)
        .and_then(|a| a.downcast_ref::<CelString>())
        .map(|s| s.inner())
        .ok_or_else(|| {
            ExecutionError::function_error(name, format!("argument {} must be a string", i + 1))
        })
}

fn commands<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    const NAME: &str = "shell.commands";
    let text = string_arg(NAME, &args, 0)?;
    if text.len() > MAX_SPLIT_BYTES {
        return Err(ExecutionError::function_error(
            NAME,
            format!(
                "the command is {} bytes, over the {MAX_SPLIT_BYTES} it splits (shell.has_flags reads any length)",
                text.len()
            ),
        ));
    }
    let lists: Vec<Box<dyn Val + 'v>> = split(text)
        .into_iter()
        .map(|words| {
            let words: Vec<Box<dyn Val + 'v>> = words
                .into_iter()
                .map(|w| Box::new(CelString::from(w)) as Box<dyn Val + 'v>)
                .collect();
            Box::new(CelList::from(words)) as Box<dyn Val + 'v>
        })
        .collect();
    Ok(CowVal::owned(CelList::from(lists)))
}

fn has_flags_fn<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    const NAME: &str = "shell.has_flags";
    let text = string_arg(NAME, &args, 0)?;
    let program = string_arg(NAME, &args, 1)?;
    if program.is_empty() {
        return Err(ExecutionError::function_error(NAME, "the program is empty"));
    }
    let Some(list) = args.get(2).and_then(|a| a.downcast_ref::<CelList>()) else {
        return Err(ExecutionError::function_error(
            NAME,
            "argument 3 must be a list of flags",
        ));
    };
    let mut flags = Vec::with_capacity(list.inner().len());
    for item in list.inner() {
        match item.downcast_ref::<CelString>() {
            Some(flag) if !flag.inner().trim_start_matches('-').is_empty() => {
                flags.push(flag.inner());
            }
            Some(_) => {
                return Err(ExecutionError::function_error(NAME, "a flag is empty"));
            }
            None => {
                return Err(ExecutionError::function_error(
                    NAME,
                    format!("flags must be strings, not {}", item.get_type().name()),
                ));
            }
        }
    }
    let found =
        has_flags(text, program, &flags).map_err(|e| ExecutionError::function_error(NAME, e))?;
    Ok(CowVal::owned(CelBool::from(found)))
}

/// Declares `shell.commands(cmd)` and `shell.has_flags(cmd, program, flags)`.
pub(crate) fn declare(env: &mut Env) {
    env.add_overload(
        "shell.commands",
        "shell_commands_string",
        vec![types::STRING_TYPE],
        commands,
    )
    .expect("the CEL library declares no `shell.commands`");
    env.add_overload(
        "shell.has_flags",
        "shell_has_flags_string_string_list",
        vec![types::STRING_TYPE, types::STRING_TYPE, types::LIST_TYPE],
        has_flags_fn,
    )
    .expect("the CEL library declares no `shell.has_flags`");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Vec<Vec<String>> {
        split(text)
    }

    const RF: [&str; 2] = ["r", "f"];

    fn flags_of(text: &str, program: &str, flags: &[&str]) -> bool {
        has_flags(text, program, flags).expect("no error")
    }

    #[test]
    fn sh_c_and_eval_are_read_into_to_a_bound() {
        for cmd in [
            "bash -c 'rm -rf /'",
            "sh -ec \"sudo rm -fr /\"",
            "sudo bash -c 'cd / && rm -r -f x'",
            "eval rm -rf /",
            "eval 'rm -rf /'",
            "sh -c \"sh -c 'rm -rf /'\"",
        ] {
            assert!(flags_of(cmd, "rm", &RF), "{cmd:?} runs rm -rf");
        }
        for cmd in ["bash -c 'rm x'", "bash script.sh -rf", "sh -x 'rm -rf /'"] {
            assert!(!flags_of(cmd, "rm", &RF), "{cmd:?}");
        }
        // Each level is read as the shell reads it: one `eval` per level.
        let deep = |levels: usize| format!("{}rm -rf /", "eval ".repeat(levels));
        assert!(flags_of(&deep(MAX_NESTING), "rm", &RF));
        let error = has_flags(&deep(MAX_NESTING + 1), "rm", &RF).unwrap_err();
        assert!(error.contains("more than 8 deep"), "{error}");
    }

    #[test]
    fn words_are_split_as_a_posix_shell_splits_them() {
        assert_eq!(words("rm -rf /"), [["rm", "-rf", "/"]]);
        assert_eq!(words(r#"'r'm "-r"f a\ b ''"#), [["rm", "-rf", "a b", ""]]);
        assert_eq!(
            words(r#"echo "a \"b\" \$c \x""#),
            [["echo", r#"a "b" $c \x"#]]
        );
        assert_eq!(words("echo a\\\nb"), [["echo", "ab"]]);
        assert_eq!(words("a # rm -rf /\nb"), [["a"], ["b"]]);
        assert_eq!(words("a#b"), [["a#b"]]);
        assert_eq!(
            words("a; b && c || d | e & f\ng (h) `i` $(j)"),
            [
                ["a"],
                ["b"],
                ["c"],
                ["d"],
                ["e"],
                ["f"],
                ["g"],
                ["h"],
                ["i"],
                ["j"]
            ]
        );
        assert_eq!(words("a 2>&1 >out <in b >>log"), [["a", "b"]]);
        // As docs/policies.md shows it.
        assert_eq!(
            words("ls; sudo rm -r x"),
            [vec!["ls"], vec!["sudo", "rm", "-r", "x"]]
        );
        assert!(words("").is_empty());
        assert!(words(" ;; && ").is_empty());
    }

    #[test]
    fn the_bypasses_of_a_text_match_are_seen() {
        for cmd in [
            "rm -rf /",
            "rm -fr /",
            "rm -r -f /",
            "rm -R -f /",
            "rm / -Rf",
            "rm -v -r -i -f /",
            "rm --recursive --force /",
            "rm --rec --fo /",
            "rm -r --force=yes /",
            "sudo rm -Rf /",
            "sudo -u root -- rm -rf /",
            "/bin/rm -rf /",
            "sudo env X=1 /usr/bin/rm -rf /",
            "X=1 rm -rf /",
            "command rm -rf /",
            "\\rm -rf /",
            "'rm' '-rf' /",
            "r\"m\" -r\"f\" /",
            "echo ok && rm -rf /",
            "true;rm -rf /",
            "false||rm -rf /",
            "ls | xargs rm -rf",
            "cd /tmp\nrm -rf /",
            "echo $(rm -rf /)",
            "echo \"$(rm -rf /)\"",
            "echo `rm -rf /`",
            "(rm -rf /)",
            "{ rm -rf /; }",
            "if true; then rm -rf /; fi",
            ">/dev/null rm -rf /",
            "2>&1 rm -rf /",
            "rm -rf / '",
            "rm -rf / \"",
            "rm -rf /\\",
            "busybox rm -rf /",
            "sudo -u rm -- rm -rf /",
            // Behind a wrapper any later `rm` counts: this runs none, and
            // is flagged all the same (a user named `rm` is not missed).
            "sudo rm -- rm -rf",
        ] {
            assert!(flags_of(cmd, "rm", &RF), "{cmd:?} runs rm -rf");
        }
    }

    #[test]
    fn other_commands_are_not_flagged() {
        for cmd in [
            "rm file.txt",
            "rm -r build",
            "rm -f file",
            "ls -rf",
            "echo rm -rf /",
            "echo 'rm -rf /'",
            "rm -- -rf",
            "rm -r -- -f",
            "sudo rm -r -- -f",
            "grep -r 'rm -rf' .",
            "rmdir -rf x",
            "# rm -rf /",
            "",
            "rm --dir -f x",
        ] {
            assert!(!flags_of(cmd, "rm", &RF), "{cmd:?} does not run rm -rf");
        }
    }

    #[test]
    fn flags_may_be_named_with_dashes_and_long_names_and_programs_by_path() {
        assert!(flags_of("rm --recursive -f x", "rm", &["-r", "--force"]));
        assert!(flags_of("/bin/rm -rf x", "/usr/bin/rm", &RF));
        assert!(flags_of("git push --force", "git", &["force"]));
        assert!(flags_of("git push -f", "git", &["f"]));
        assert!(
            !flags_of("git push -F", "git", &["f"]),
            "case is the program's"
        );
        assert!(flags_of("chmod -R 777 /", "chmod", &["recursive"]));
        assert!(flags_of("rm x", "rm", &[]), "no flags: runs the program");
        assert!(!flags_of("ls x", "rm", &[]));
    }

    /// Hostile inputs are read in time linear in their bytes, with no
    /// recursion: nothing hangs, overflows the stack or panics.
    #[test]
    fn hostile_commands_are_bounded() {
        let mib = 1 << 20;
        let padded = format!("{}rm -rf /", " ".repeat(mib));
        assert!(flags_of(&padded, "rm", &RF));
        let words = "a ".repeat(mib / 2);
        assert!(!flags_of(&words, "rm", &RF));
        let quotes = "\"'".repeat(mib / 2);
        assert!(!flags_of(&quotes, "rm", &RF));
        let subs = "$(\"".repeat(mib / 3);
        assert!(!flags_of(&subs, "rm", &RF));
        let nested = format!("{}rm -rf /", "$(\"`".repeat(mib / 4));
        assert!(flags_of(&nested, "rm", &RF));
        // A program named many times behind a wrapper is read once, not
        // once per name (that was quadratic).
        let names = format!("sudo {}", "rm ".repeat(mib / 3));
        assert!(!flags_of(&names, "rm", &RF));
        assert!(flags_of(&format!("{names} -rf"), "rm", &RF));
        let evals = format!("sudo {}", "eval ".repeat(mib / 5));
        assert!(has_flags(&evals, "rm", &RF).is_err(), "nested too deep");
        let shells = format!("sudo {}", "sh -c x ".repeat(mib / 8));
        assert!(!flags_of(&shells, "rm", &RF));
        let backslashes = "\\".repeat(mib + 1);
        assert!(!flags_of(&backslashes, "rm", &RF));
        assert!(!flags_of("'unterminated", "rm", &RF));
        assert!(flags_of("rm -rf '/unterminated", "rm", &RF));
        assert!(!flags_of("\u{0}\u{fffd}\u{202e}rm -rf", "rm", &RF));
    }
}
