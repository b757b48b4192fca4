//! Subject templates: `outbox.{event_type}.{key}` → `outbox.order.created.o%2D7`-style subjects.
//!
//! `{key}` is always escaped to a single subject token: bytes outside `[A-Za-z0-9_-]` become `%XX`, so
//! any key (spaces, dots, `*`, `>`, non-ASCII) yields a valid, unambiguous token. `{event_type}` keeps
//! its dots (event hierarchies like `order.created` become subject levels) unless they would make an
//! empty token, and escapes everything else the same way. `{partition}` is the partition number.

use outbox_core::Record;

use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    EventType,
    Key,
    Partition,
}

/// A parsed subject template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectTemplate {
    parts: Vec<Part>,
}

impl SubjectTemplate {
    /// Parses `template`; unknown placeholders and characters invalid in subjects are errors.
    pub fn parse(template: &str) -> Result<Self> {
        let bad = |msg: String| Err(Error::Config(format!("subject template {template:?}: {msg}")));
        let mut parts = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Literal(rest[..open].to_string()));
            }
            let Some(close) = rest[open..].find('}') else { return bad("unclosed '{'".into()) };
            parts.push(match &rest[open + 1..open + close] {
                "event_type" => Part::EventType,
                "key" => Part::Key,
                "partition" => Part::Partition,
                other => {
                    return bad(format!(
                        "unknown placeholder {{{other}}}; use {{event_type}}, {{key}} or {{partition}}"
                    ));
                }
            });
            rest = &rest[open + close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Literal(rest.to_string()));
        }
        for part in &parts {
            if let Part::Literal(text) = part
                && text.chars().any(|c| c.is_whitespace() || matches!(c, '*' | '>' | '{' | '}'))
            {
                return bad(format!("literal {text:?} has a character invalid in a publish subject"));
            }
        }
        let template = Self { parts };
        let sample = template.render_parts("t", "k", 0);
        if sample.is_empty() || sample.split('.').any(str::is_empty) {
            return bad("renders empty subject tokens (check the dots)".into());
        }
        Ok(template)
    }

    /// Whether the stream subject `pattern` captures some of the subjects this template renders: those
    /// of a template without placeholders exactly, else the tokens before the first placeholder (an
    /// event type may span any number of tokens, so little more can be known).
    pub fn may_be_captured_by(&self, pattern: &str) -> bool {
        let mut leading = String::new();
        for part in &self.parts {
            match part {
                Part::Literal(text) => leading.push_str(text),
                _ => {
                    // Only the whole tokens before the placeholder are known; more tokens follow them.
                    let known: Vec<&str> = leading.split('.').collect();
                    let known = &known[..known.len() - 1];
                    let mut tokens = pattern.split('.');
                    for literal in known {
                        match tokens.next() {
                            Some(">") => return true,
                            Some(token) if token == "*" || token == *literal => {}
                            _ => return false,
                        }
                    }
                    return tokens.next().is_some();
                }
            }
        }
        matches(pattern, &leading)
    }

    /// The subject of `record`.
    pub fn render(&self, record: &Record) -> String {
        self.render_parts(&record.event_type, &record.key, record.partition)
    }

    fn render_parts(&self, event_type: &str, key: &str, partition: u8) -> String {
        let mut subject = String::new();
        for part in &self.parts {
            match part {
                Part::Literal(text) => subject.push_str(text),
                Part::EventType => {
                    let dots_ok =
                        !event_type.starts_with('.') && !event_type.ends_with('.') && !event_type.contains("..");
                    escape(event_type, dots_ok, &mut subject);
                }
                Part::Key => escape(key, false, &mut subject),
                Part::Partition => subject.push_str(&partition.to_string()),
            }
        }
        subject
    }
}

fn escape(text: &str, keep_dots: bool, out: &mut String) {
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-' || (keep_dots && byte == b'.') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
}

/// Whether `subject` is captured by the stream subject `pattern` (`*` one token, `>` the rest).
pub fn matches(pattern: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for token in pattern.split('.') {
        match (token, subject_tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (literal, Some(actual)) if literal == actual => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str, event_type: &str) -> Record {
        Record {
            id: uuid::Uuid::nil(),
            partition: 42,
            key: key.into(),
            seq: 1,
            event_type: event_type.into(),
            payload: bytes::Bytes::new(),
            headers: Default::default(),
            attempts: 0,
            created_at: chrono::Utc::now(),
            deliver_at: None,
            epoch: outbox_core::Epoch(1),
        }
    }

    #[test]
    fn renders_and_escapes_every_key_to_one_token() {
        let t = SubjectTemplate::parse("outbox.{event_type}.{partition}.{key}").unwrap();
        assert_eq!(t.render(&record("order-7", "order.created")), "outbox.order.created.42.order-7");
        assert_eq!(t.render(&record("a.b c*>é", "x")), "outbox.x.42.a%2Eb%20c%2A%3E%C3%A9");
        assert_eq!(t.render(&record("k", ".odd..type")), "outbox.%2Eodd%2E%2Etype.42.k");
        for key in ["a.b", "*", ">", " ", "..", "ü"] {
            let subject = t.render(&record(key, "t"));
            assert_eq!(subject.split('.').count(), 4, "{key:?} → {subject}");
            assert!(matches("outbox.>", &subject));
        }
    }

    #[test]
    fn rejects_bad_templates() {
        for bad in ["outbox.{nope}", "outbox.{key", "out box.{key}", "outbox..{key}", "outbox.*", ""] {
            assert!(SubjectTemplate::parse(bad).is_err(), "{bad:?}");
        }
    }

    /// What a stream subject can be known to miss: every subject of a template without placeholders, or
    /// the tokens before the first placeholder.
    #[test]
    fn a_stream_subject_that_captures_none_of_a_template_is_told() {
        let captured =
            |template: &str, pattern: &str| SubjectTemplate::parse(template).unwrap().may_be_captured_by(pattern);
        assert!(captured("outbox.{event_type}.{key}", "outbox.>"));
        assert!(captured("outbox.{event_type}.{key}", "*.>"));
        assert!(captured("outbox.{event_type}.{key}", "outbox.*.*"), "event types without dots");
        assert!(captured("{event_type}", "orders.>"), "nothing known before the event type");
        assert!(captured("a.b{key}", "a.*"));
        assert!(captured("outbox", "outbox"));
        assert!(!captured("events.{event_type}", "outbox.>"));
        assert!(!captured("outbox.{key}", "outbox"), "a token follows");
        assert!(!captured("outbox", "outbox.>"));
        assert!(!captured("a.b.{key}", "a.c.>"));
    }

    #[test]
    fn wildcard_matching() {
        assert!(matches("outbox.>", "outbox.a.b"));
        assert!(!matches("outbox.>", "outbox"));
        assert!(matches("outbox.*.x", "outbox.a.x"));
        assert!(!matches("outbox.*", "outbox.a.b"));
        assert!(matches("a.b", "a.b") && !matches("a.b", "a.c"));
    }
}
