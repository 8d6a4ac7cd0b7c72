//! Which requests are a channel's: the hosts of its addresses, or an InMemoryChannel's
//! conventional one. (A host two channels claim is decided where the last good versions
//! are known: render.rs.)

use super::objects::{text, Group};
use super::uris::split_host_port;
use super::Report;
use crate::model::{MapOptions, Problem};
use serde_json::Value;

/// The hosts of the channel's addresses (with the warnings they call for).
pub(super) fn channel_hosts(
    group: &Group,
    options: &MapOptions,
    report: &mut Report,
) -> Vec<String> {
    // Each host with whether a sender reaches it over plain http too.
    let mut hosts: Vec<(String, bool)> = Vec::new();
    for member in &group.members {
        let mut urls: Vec<String> = text(&member.doc, &["status", "address", "url"])
            .into_iter()
            .collect();
        if let Some(Value::Array(addresses)) = member.at(&["status", "addresses"]) {
            urls.extend(addresses.iter().filter_map(|a| text(a, &["url"])));
        }
        for url in urls {
            let Some(host) = url_host(&url) else { continue };
            let plain = !url.to_ascii_lowercase().starts_with("https://");
            match hosts.iter_mut().find(|(h, _)| *h == host) {
                Some((_, p)) => *p |= plain,
                None => hosts.push((host, plain)),
            }
        }
        let audience = text(&member.doc, &["status", "address", "audience"]);
        if let Some(audience) = audience.filter(|_| options.senders.is_none()) {
            let message = format!(
                "senders' OIDC tokens (audience {audience:?}) are not checked: run with \
                 --oidc-issuer to enforce who may send"
            );
            let warning = Problem::new(&member.label, "status.address.audience", message);
            report.warn(Some(&group.name), warning);
        }
    }
    for (host, _) in hosts.iter().filter(|(_, plain)| !plain) {
        let message = format!(
            "senders reach this channel over https ({host}); the bootstrap's listener is \
             plain HTTP: terminate TLS in front of it"
        );
        let warning = Problem::new(&group.primary.label, "status.address.url", message);
        report.warn(Some(&group.name), warning);
    }
    if hosts.is_empty() {
        return conventional_host(group, report);
    }
    hosts.into_iter().map(|(h, _)| h).collect()
}

/// A channel whose status names no address: an InMemoryChannel's conventional host (a
/// warning), or none (a problem).
fn conventional_host(group: &Group, report: &mut Report) -> Vec<String> {
    if let Some(imc) = in_memory_name(group) {
        let host = format!(
            "{imc}-kn-channel.{}.svc.cluster.local",
            group.primary.namespace
        );
        let message = format!("missing: matched by the InMemoryChannel's conventional host {host}");
        let warning = Problem::new(&group.primary.label, "status.address.url", message);
        report.warn(Some(&group.name), warning);
        return vec![host];
    }
    report.channel(
        &group.name,
        Problem::new(
            &group.primary.label,
            "status.address.url",
            "missing, and the channel is not an InMemoryChannel whose conventional host could \
             stand in: fanout could not tell which requests are for it",
        ),
    );
    Vec::new()
}

/// The name of the InMemoryChannel behind `group`, if it is one: a member, or what a
/// Channel's status (or template) says backs it.
fn in_memory_name(group: &Group) -> Option<String> {
    if let Some(imc) = group.members.iter().find(|m| m.kind == "InMemoryChannel") {
        return Some(imc.name.clone());
    }
    let primary = &group.primary;
    let backing = primary
        .at(&["status", "channel"])
        .or_else(|| primary.at(&["spec", "channelTemplate"]));
    let kind = backing.and_then(|b| text(b, &["kind"]));
    (primary.kind == "Channel" && kind.as_deref().is_none_or(|k| k == "InMemoryChannel"))
        .then(|| text(&primary.doc, &["status", "channel", "name"]).unwrap_or(primary.name.clone()))
}

/// The host of an address's URL as requests name it: lower case, an IPv6 address in
/// brackets.
fn url_host(url: &str) -> Option<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let (host, _) = split_host_port(authority).ok()?;
    let host = host.to_ascii_lowercase();
    match host.as_str() {
        "" => None,
        ipv6 if ipv6.contains(':') => Some(format!("[{ipv6}]")),
        _ => Some(host),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_host_is_named_as_requests_name_it() {
        assert_eq!(
            url_host("http://A.Example:8080/x").as_deref(),
            Some("a.example")
        );
        assert_eq!(url_host("http://[::1]:8080/").as_deref(), Some("[::1]"));
        assert_eq!(
            url_host("http://u:p@a.example/").as_deref(),
            Some("a.example")
        );
        assert_eq!(url_host("http:///x"), None);
    }
}
