//! URIs and TLS: an http(s) URI as fanout calls it (its cluster, authority and path), the
//! clusters the channel's calls need, and the CA certificates an https cluster trusts.

use super::Report;
use crate::model::{ChannelSpec, ClusterSpec, Problem};
use fanout::config::RawTarget;
use std::collections::BTreeSet;

/// Where a subscriber comes from, for its problems.
pub(super) struct Source<'a> {
    pub(super) channel: &'a str,
    pub(super) object: &'a str,
}

/// A reply address: its URI, the field it came from, its CA certificates.
pub(super) type Reply = (String, String, Option<String>);

type Place = (String, String, String);

#[derive(Default)]
pub(super) struct TlsUse {
    pub(super) with_ca: Vec<(Place, String)>,
    pub(super) without_ca: Option<Place>,
}

/// The https clusters whose URIs disagree on the CA certificates: the cluster trusts the
/// ones named, all of them.
pub(super) fn check_tls(report: &mut Report) {
    let mut found = Vec::new();
    for (cluster, uses) in &report.tls {
        let Some(((channel, object, field), _)) = uses.with_ca.first() else {
            continue;
        };
        if let Some((without_channel, without_object, without_field)) = &uses.without_ca {
            let message = format!(
                "names no CA certificates, but {object} {field} does, for the same cluster \
                 {cluster}: the cluster trusts only the named ones"
            );
            let warning = Problem::new(without_object, without_field, message);
            found.push((without_channel.clone(), warning));
        }
        let sets: BTreeSet<&String> = uses.with_ca.iter().map(|(_, ca)| ca).collect();
        if sets.len() > 1 {
            let message = format!(
                "the URIs of cluster {cluster} name {} different sets of CA certificates: the \
                 cluster trusts all of them",
                sets.len()
            );
            found.push((channel.clone(), Problem::new(object, field, message)));
        }
    }
    for (channel, warning) in found {
        report.warn(Some(&channel), warning);
    }
}

/// A call target (`cluster`, `authority`, `path`) for `uri`, its cluster added to `spec`.
pub(super) fn target(
    source: &Source,
    uri: &str,
    field: &str,
    ca: Option<String>,
    spec: &mut ChannelSpec,
    report: &mut Report,
) -> Option<RawTarget> {
    let parsed = match parse_uri(uri) {
        Ok(parsed) => parsed,
        Err(why) => {
            let problem = Problem::new(source.object, field, format!("{uri:?}: {why}"));
            report.channel(source.channel, problem);
            return None;
        }
    };
    let scheme = if parsed.tls { "https" } else { "http" };
    let name = format!("{scheme}|{}|{}", parsed.host, parsed.port);
    let cluster = spec
        .clusters
        .entry(name.clone())
        .or_insert_with(|| ClusterSpec {
            name: name.clone(),
            tls: parsed.tls,
            host: parsed.host.clone(),
            port: parsed.port,
            ca_certs: Vec::new(),
        });
    let ca = ca.map(|c| c.trim().to_owned()).filter(|c| !c.is_empty());
    if parsed.tls {
        let place = (
            source.channel.to_owned(),
            source.object.to_owned(),
            field.to_owned(),
        );
        let uses = report.tls.entry(name.clone()).or_default();
        match &ca {
            Some(ca) => uses.with_ca.push((place, ca.clone())),
            None => {
                uses.without_ca.get_or_insert(place);
            }
        }
    }
    if let Some(ca) = ca.filter(|_| parsed.tls) {
        if !cluster.ca_certs.contains(&ca) {
            cluster.ca_certs.push(ca);
        }
    }
    Some(RawTarget {
        cluster: name,
        authority: Some(parsed.authority),
        path: Some(parsed.path),
        ..RawTarget::default()
    })
}

/// An http(s) URI as fanout calls it.
#[derive(Debug, PartialEq)]
pub struct Uri {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    pub authority: String,
    pub path: String,
}

/// Parse an absolute http or https URI; the error says why fanout cannot call it.
pub fn parse_uri(uri: &str) -> Result<Uri, String> {
    let (scheme, rest) = uri.split_once("://").ok_or("not an absolute URI")?;
    let tls = match scheme.to_ascii_lowercase().as_str() {
        "http" => false,
        "https" => true,
        _ => return Err("fanout calls absolute http and https URIs only".into()),
    };
    let (authority, path) = match rest.find(['/', '?', '#']) {
        Some(i) => rest.split_at(i),
        None => (rest, "/"),
    };
    if authority.contains('@') {
        return Err("credentials in a URI are not carried over".into());
    }
    let path = path.split('#').next().unwrap_or("/");
    // `http://h#f` and `http://h?q` call `/` and `/?q`.
    let path = if path.is_empty() || path.starts_with('?') {
        format!("/{path}")
    } else {
        path.to_owned()
    };
    let (host, port) = split_host_port(authority)?;
    let host = host.to_ascii_lowercase();
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | ':');
    if host.is_empty() || !host.chars().all(valid) {
        return Err("no valid host name".into());
    }
    let shown = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.clone()
    };
    Ok(Uri {
        tls,
        authority: port.map_or(shown.clone(), |p| format!("{shown}:{p}")),
        port: port.unwrap_or(if tls { 443 } else { 80 }),
        host,
        path,
    })
}

pub(super) fn split_host_port(authority: &str) -> Result<(&str, Option<u16>), String> {
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or("an unclosed [ in the host")?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    let port = match port {
        None | Some("") => None,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => Some(p),
            _ => return Err(format!("port {p:?} is not a port")),
        },
    };
    Ok((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        let u = parse_uri("https://[::1]:8443/p?q=1").unwrap();
        assert_eq!(
            (
                u.host.as_str(),
                u.port,
                u.authority.as_str(),
                u.path.as_str()
            ),
            ("::1", 8443, "[::1]:8443", "/p?q=1")
        );
        assert!(parse_uri("http://user:pw@h/").is_err());
        assert!(parse_uri("http://h:0/").is_err());
        assert_eq!(parse_uri("http://H.example").unwrap().path, "/");
        assert_eq!(parse_uri("http://h.example#f").unwrap().path, "/");
    }
}
