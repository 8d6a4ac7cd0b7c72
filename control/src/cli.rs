//! The options that say how the Knative objects become Envoy's configuration: the same for
//! the server (`fanout-control --source ...`) and for `fanout-control render`.

use crate::model::{AuthorizationMode, MapOptions};
use crate::render::{RenderOptions, Resolve};
use crate::senders::Oidc;
use std::time::Duration;

/// How the objects are mapped and rendered.
#[derive(clap::Args, Debug, Clone)]
pub struct ConfigArgs {
    /// fanout.wasm as the Envoys see it (a local file on their machine).
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/etc/fanout-wasm/fanout.wasm"
    )]
    pub wasm: String,
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

    /// How the mapped channels become Envoy's resources.
    pub fn render_options(&self) -> RenderOptions {
        RenderOptions {
            wasm: self.wasm.clone(),
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
}
