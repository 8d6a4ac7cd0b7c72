//! `fanout-control render`: the configuration the server would serve, written to files for
//! Envoys that read it from disk (the static, Istio and ConfigMap set-ups) instead of over
//! xDS. The same source, the same mapping and the same resources as the server: only where
//! they go differs. Into `--out` it writes
//!
//! - `fanout.json`: the filter's configuration, for review;
//! - `fanout.yaml`: ECDS, the fanout filter with that configuration;
//! - `clusters.yaml`: CDS, one cluster per scheme, host and port the URIs name;
//! - with `--oidc-issuer`, `senders-jwt.yaml` and `senders-rbac.yaml`: ECDS, who may send.
//!
//! Unlike the server, which keeps serving the other channels, render is all or nothing: a
//! problem in any channel is an error, and then nothing is written (exit status 1).

use crate::cli::ConfigArgs;
use crate::model::{Problem, Snapshot};
use crate::render::{self, Served};
use crate::resource_json;
use crate::source::{self, DirSource, Listing};
use clap::{CommandFactory, FromArgMatches, Parser};
use serde_json::{json, Value};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const PREFIX: &str = "fanout-control render";

/// Write fanout's configuration for Envoys that read files (ECDS and CDS documents), from a
/// directory of Knative objects: what the server would serve from it.
#[derive(Parser, Debug)]
#[command(
    name = "fanout-control render",
    bin_name = "fanout-control render",
    version
)]
struct RenderArgs {
    /// The Knative objects: `dir:PATH`, a directory of Channels, InMemoryChannels,
    /// Subscriptions and EventPolicies as `kubectl get -o yaml` (or `-o json`) writes them.
    #[arg(long, value_name = "dir:PATH")]
    source: String,
    /// Where to write fanout.json, fanout.yaml, clusters.yaml (and with --oidc-issuer
    /// senders-jwt.yaml and senders-rbac.yaml); created if missing.
    #[arg(long, value_name = "DIR", default_value = ".")]
    out: PathBuf,
    #[command(flatten)]
    config: ConfigArgs,
}

/// Runs `render` with its arguments (`args`: from the word `render` on).
pub fn main(args: impl Iterator<Item = OsString>) -> ExitCode {
    let matches = RenderArgs::command().get_matches_from(args);
    let args = RenderArgs::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Some(message) = args.config.mismatch(&matches) {
        RenderArgs::command()
            .error(clap::error::ErrorKind::ArgumentConflict, message)
            .exit();
    }
    let listing = match read(&args.source) {
        Ok(listing) => listing,
        Err(lines) => {
            for line in lines {
                eprintln!("{PREFIX}: {line}");
            }
            return ExitCode::from(2);
        }
    };
    let policies = listing
        .objects
        .iter()
        .filter(|o| is_event_policy(o))
        .count();
    let snapshot = source::mapped(&args.config.map_options(), listing);
    let served = render::serve(&snapshot, None, &args.config.render_options());
    let (errors, warnings) = report(&args.source, &snapshot, &served);
    for warning in &warnings {
        eprintln!("{PREFIX}: warning: {warning}");
    }
    if !errors.is_empty() {
        for error in &errors {
            eprintln!("{PREFIX}: error: {error}");
        }
        eprintln!("{PREFIX}: {} error(s); nothing written", errors.len());
        return ExitCode::FAILURE;
    }
    let senders = args.config.oidc_issuer.is_some();
    match write(&args.out, &served, senders) {
        Ok(()) => {
            println!(
                "{}",
                summary(
                    &args.out,
                    &served,
                    senders.then_some(policies),
                    warnings.len()
                )
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{PREFIX}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The objects of `--source`; what cannot be read is not the objects' problem (exit 2, as
/// for a bad argument): the lines to say.
fn read(source: &str) -> Result<Listing, Vec<String>> {
    let Some(dir) = source.strip_prefix("dir:").filter(|d| !d.is_empty()) else {
        return Err(vec![format!("--source {source:?}: expected dir:PATH")]);
    };
    if let Err(e) = std::fs::read_dir(dir) {
        return Err(vec![format!("--source {source}: cannot read: {e}")]);
    }
    let listing = DirSource::new(PathBuf::from(dir))
        .poll()
        .unwrap_or_default();
    let mut lines: Vec<String> = listing
        .problems
        .iter()
        .map(|p| format!("error: {}", line(p)))
        .collect();
    if listing.objects.is_empty() {
        lines.push(format!("--source {source}: no Kubernetes objects in it"));
    }
    if lines.is_empty() {
        Ok(listing)
    } else {
        Err(lines)
    }
}

fn is_event_policy(object: &Value) -> bool {
    let api_version = object.get("apiVersion").and_then(Value::as_str);
    object.get("kind").and_then(Value::as_str) == Some("EventPolicy")
        && api_version.is_some_and(|v| v.starts_with("eventing.knative.dev/"))
}

/// Every problem is an error; every warning is said once.
fn report(source: &str, snapshot: &Snapshot, served: &Served) -> (Vec<String>, Vec<String>) {
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    for channel in served.channels.values() {
        errors.extend(channel.problems.iter().map(line));
        warnings.extend(channel.warnings.iter().map(line));
    }
    errors.extend(snapshot.problems.iter().map(line));
    warnings.extend(served.warnings.iter().map(line));
    if snapshot.channels.is_empty() {
        let message =
            "holds no Channel or InMemoryChannel (messaging.knative.dev): nothing to move";
        errors.push(line(&Problem::new(source, "", message)));
    }
    (once_each(errors), once_each(warnings))
}

fn line(problem: &Problem) -> String {
    if problem.field.is_empty() {
        format!("{}: {}", problem.object, problem.message)
    } else {
        format!("{}: {}: {}", problem.object, problem.field, problem.message)
    }
}

fn once_each(lines: Vec<String>) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    lines
        .into_iter()
        .filter(|l| seen.insert(l.clone()))
        .collect()
}

/// The files, each written whole (beside its name, then renamed over it): clusters before the
/// filters, so an Envoy watching `out` never meets a subscriber whose cluster it lacks.
fn write(out: &Path, served: &Served, senders: bool) -> Result<(), String> {
    let mut filters = Vec::new();
    for resource in &served.ecds {
        let resource = resource_json::any(resource)?;
        let name = resource
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        filters.push((name, resource));
    }
    let plugin = filters
        .iter()
        .find(|(name, _)| name == render::FILTER_NAME)
        .and_then(|(_, r)| {
            // The wasm filter's plugin configuration, or the native build's filter_config.
            r.pointer("/typed_config/config/configuration/value")
                .or_else(|| r.pointer("/typed_config/filter_config/value"))
        })
        .and_then(Value::as_str)
        .ok_or("the served filter has no configuration")?;
    let plugin: Value = serde_json::from_str(plugin).map_err(|e| e.to_string())?;
    let clusters = served
        .clusters
        .values()
        .map(resource_json::any)
        .collect::<Result<Vec<_>, _>>()?;
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    write_json(out, "fanout.json", &plugin)?;
    write_json(out, "clusters.yaml", &discovery_response(clusters))?;
    filters.sort_by_key(|(name, _)| name == render::FILTER_NAME);
    for (name, resource) in filters {
        if senders || name == render::FILTER_NAME {
            write_json(
                out,
                &format!("{name}.yaml"),
                &discovery_response(vec![resource]),
            )?;
        }
    }
    Ok(())
}

/// A DiscoveryResponse as Envoy reads it from a file. Its version is informative (Envoy
/// shows it as the `version_text` stat): a digest of the content.
fn discovery_response(resources: Vec<Value>) -> Value {
    let version = render::digest(&Value::Array(resources.clone()).to_string());
    json!({ "version_info": version, "resources": resources })
}

fn write_json(dir: &Path, name: &str, document: &Value) -> Result<(), String> {
    let path = dir.join(name);
    let text = serde_json::to_string_pretty(document).map_err(|e| e.to_string())? + "\n";
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("cannot write {}: {e}", path.display())
        })
}

fn summary(out: &Path, served: &Served, policies: Option<usize>, warnings: usize) -> String {
    let channels: Vec<_> = served
        .channels
        .values()
        .filter(|c| c.serving != render::Serving::NotServed)
        .collect();
    let subscribers: usize = channels.iter().map(|c| c.spec.subscribers.len()).sum();
    let mut text = format!(
        "{PREFIX}: wrote {}, fanout.yaml and clusters.yaml: {} channel(s), {subscribers} \
         subscriber(s), {} cluster(s)",
        out.join("fanout.json").display(),
        channels.len(),
        served.clusters.len()
    );
    if let Some(policies) = policies {
        text += &format!(", {policies} EventPolicy(ies) in senders-jwt.yaml and senders-rbac.yaml");
    }
    if warnings > 0 {
        text += &format!(", {warnings} warning(s)");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::Build;
    use crate::model::MapOptions;
    use crate::render::RenderOptions;

    /// `render --build native` writes the native build's filter, and the fan-out JSON it
    /// carries as `fanout.json`.
    #[test]
    fn the_native_filter_is_written_with_its_configuration() {
        let channel = json!({
            "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
            "metadata": { "name": "a", "namespace": "default" },
            "spec": { "subscribers": [{ "subscriberUri": "http://x.example/" }] },
            "status": { "address": { "url": "http://a.example" } }
        });
        let snapshot = crate::knative::map(&MapOptions::default(), vec![channel]);
        let options = RenderOptions {
            build: Build::Native("fanout".into()),
            trusted_ca: "/ca.crt".into(),
            oidc: None,
            resolve: Vec::new(),
            connect_timeout: std::time::Duration::from_secs(1),
        };
        let served = render::serve(&snapshot, None, &options);
        let out = std::env::temp_dir().join(format!("fanout-render-native-{}", std::process::id()));
        let written = write(&out, &served, false);
        let read = |name: &str| std::fs::read_to_string(out.join(name));
        let (filter, plugin) = (read("fanout.yaml"), read("fanout.json"));
        let _ = std::fs::remove_dir_all(&out);
        written.unwrap();
        let filter: Value = serde_json::from_str(&filter.unwrap()).unwrap();
        let carried = &filter["resources"][0]["typed_config"];
        assert_eq!(carried["dynamic_module_config"]["name"], "fanout");
        let carried: Value =
            serde_json::from_str(carried["filter_config"]["value"].as_str().unwrap()).unwrap();
        let plugin: Value = serde_json::from_str(&plugin.unwrap()).unwrap();
        assert_eq!(carried, plugin);
        assert_eq!(plugin["channels"][0]["hosts"], json!(["a.example"]));
    }
}
