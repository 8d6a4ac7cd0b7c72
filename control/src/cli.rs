//! The options that say how the Knative objects become Envoy's configuration: the same for
//! the server (`fanout-control --source ...`) and for `fanout-control render`.

use crate::contract::Build;
use crate::model::{AuthorizationMode, MapOptions};
use crate::render::{RenderOptions, Resolve};
use crate::senders::Oidc;
use clap::parser::ValueSource;
use clap::ArgMatches;
use std::time::Duration;

/// Which build of fanout the Envoys load (`--build`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildArg {
    /// The wasm module (`--wasm`), in Envoy's wasm runtime.
    Wasm,
    /// The native build, an Envoy dynamic module (`--native-module`): Envoy 1.40.0 or later,
    /// and only what it serves (docs/native.md).
    Native,
}

/// How the objects are mapped and rendered.
#[derive(clap::Args, Debug, Clone)]
pub struct ConfigArgs {
    /// Which build of fanout the Envoys load: the fanout filter is served as the wasm filter
    /// (envoy.filters.http.wasm) or as the native build's (envoy.filters.http.dynamic_modules).
    #[arg(long, value_name = "BUILD", value_enum, default_value_t = BuildArg::Wasm)]
    pub build: BuildArg,
    /// fanout.wasm as the Envoys see it (a local file on their machine); with --build wasm.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/etc/fanout-wasm/fanout.wasm"
    )]
    pub wasm: String,
    /// The native build as the Envoys see it, with --build native: a NAME (Envoy loads
    /// `lib<NAME>.so` from the directory in its ENVOY_DYNAMIC_MODULES_SEARCH_PATH, then from
    /// the system's library paths), or the library's absolute PATH on their machine.
    #[arg(long, value_name = "NAME|PATH", default_value = "fanout", value_parser = native_module)]
    pub native_module: String,
    /// The CA bundle an https subscriber's certificate is checked against when the source
    /// names no CA certificates for it, as the Envoys see it.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/etc/ssl/certs/ca-certificates.crt"
    )]
    pub trusted_ca: String,
    /// Every subscriber cluster's connect_timeout: seconds, as Envoy writes a duration
    /// (`1s`, `0.25s`).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = seconds)]
    pub connect_timeout: Duration,
    /// Check senders' OIDC tokens from this issuer and enforce the EventPolicies (Knative's
    /// OIDC authentication): the `senders-jwt` and `senders-rbac` filters that the
    /// bootstraps run before fanout. Without it, those let every request through, and a
    /// channel in a namespace with an EventPolicy is refused (the server keeps it as it was).
    #[arg(long, value_name = "URL")]
    pub oidc_issuer: Option<String>,
    /// The issuer's JWKS as the Envoys see it (with --oidc-issuer).
    #[arg(long, value_name = "FILE", default_value = "/etc/fanout/jwks.json")]
    pub jwks: String,
    /// Who may send to a channel no EventPolicy applies to (with --oidc-issuer): Knative's
    /// default-authorization-mode, same words, same default.
    #[arg(long, value_name = "MODE", value_enum, default_value_t = AuthorizationMode::AllowSameNamespace)]
    pub default_authorization_mode: AuthorizationMode,
    /// Reach HOST (on PORT only, when given) at ADDRESS:PORT instead of its DNS name
    /// (repeatable); calls keep the URI's authority, and https its SNI and certificate
    /// check on HOST.
    #[arg(long, value_name = "HOST[:PORT]=ADDRESS:PORT")]
    pub resolve: Vec<Resolve>,
}

impl ConfigArgs {
    /// How the Knative objects are mapped.
    pub fn map_options(&self) -> MapOptions {
        MapOptions {
            senders: self
                .oidc_issuer
                .as_ref()
                .map(|_| self.default_authorization_mode),
        }
    }

    /// An option given for the build the Envoys do not load (`--wasm` with `--build
    /// native`, `--native-module` with `--build wasm`): what to say, instead of ignoring it.
    pub fn mismatch(&self, matches: &ArgMatches) -> Option<String> {
        let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
        let (other, build) = match self.build {
            BuildArg::Wasm => ("--native-module", "wasm"),
            BuildArg::Native => ("--wasm", "native"),
        };
        let id = other.trim_start_matches("--").replace('-', "_");
        given(&id).then(|| {
            format!("{other} is not used with --build {build}: the Envoys load the {build} build")
        })
    }

    /// How the mapped channels become Envoy's resources.
    pub fn render_options(&self) -> RenderOptions {
        RenderOptions {
            build: match self.build {
                BuildArg::Wasm => Build::Wasm(self.wasm.clone()),
                BuildArg::Native => Build::Native(self.native_module.clone()),
            },
            trusted_ca: self.trusted_ca.clone(),
            oidc: self.oidc_issuer.clone().map(|issuer| Oidc {
                issuer,
                jwks: self.jwks.clone(),
            }),
            resolve: self.resolve.clone(),
            connect_timeout: self.connect_timeout,
        }
    }
}

/// `--native-module`: a library's name (no `/`), or an absolute path.
fn native_module(text: &str) -> Result<String, String> {
    if text.is_empty() || (text.contains('/') && !text.starts_with('/')) {
        return Err(format!(
            "{text:?}: expected a name (fanout, for libfanout.so in \
             ENVOY_DYNAMIC_MODULES_SEARCH_PATH) or an absolute path"
        ));
    }
    Ok(text.to_owned())
}

/// `1s`, `0.25s`: a positive number of seconds with an `s`, as Envoy's JSON writes a duration.
fn seconds(text: &str) -> Result<Duration, String> {
    let number = text
        .strip_suffix('s')
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit() || b == b'.'));
    number
        .and_then(|n| n.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 315_576_000_000.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("{text:?}: expected seconds, e.g. 1s or 0.25s"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_timeouts_are_seconds() {
        assert_eq!(seconds("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(seconds("0.25s"), Ok(Duration::from_millis(250)));
        for bad in ["1", "s", "0s", "-1s", "1ms", "1e3s", "1.2.3s"] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_native_module_is_a_name_or_an_absolute_path() {
        assert_eq!(native_module("fanout"), Ok("fanout".into()));
        assert_eq!(
            native_module("/etc/envoy/modules/libfanout.so"),
            Ok("/etc/envoy/modules/libfanout.so".into())
        );
        for bad in ["", "modules/libfanout.so", "./libfanout.so"] {
            assert!(native_module(bad).is_err(), "{bad}");
        }
    }

    #[derive(clap::Parser, Debug)]
    struct Parsed {
        #[command(flatten)]
        config: ConfigArgs,
    }

    fn parsed(args: &[&str]) -> (ConfigArgs, ArgMatches) {
        use clap::{CommandFactory, FromArgMatches};
        let matches = Parsed::command()
            .try_get_matches_from(std::iter::once("x").chain(args.iter().copied()))
            .unwrap();
        let config = Parsed::from_arg_matches(&matches).unwrap().config;
        (config, matches)
    }

    #[test]
    fn the_default_is_the_wasm_build_and_the_other_builds_options_are_refused() {
        let (config, matches) = parsed(&[]);
        assert_eq!(config.build, BuildArg::Wasm);
        assert!(config.mismatch(&matches).is_none());
        assert!(matches!(
            config.render_options().build,
            Build::Wasm(path) if path == "/etc/fanout-wasm/fanout.wasm"
        ));
        let (config, matches) = parsed(&["--build", "native"]);
        assert!(config.mismatch(&matches).is_none());
        assert!(matches!(config.render_options().build, Build::Native(m) if m == "fanout"));
        let (config, matches) = parsed(&["--build", "native", "--wasm", "/x.wasm"]);
        let said = config.mismatch(&matches).unwrap();
        assert!(
            said.starts_with("--wasm is not used with --build native"),
            "{said}"
        );
        let (config, matches) = parsed(&["--native-module", "/lib/libfanout.so"]);
        let said = config.mismatch(&matches).unwrap();
        assert!(
            said.starts_with("--native-module is not used with --build wasm"),
            "{said}"
        );
    }
}
