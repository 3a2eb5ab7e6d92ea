package main

import (
	"flag"
	"fmt"
	"net/url"

	"github.com/trajflow/trajflow/internal/loop"
	"github.com/trajflow/trajflow/pipeline/contract"
)

// policyFlags are the demo's flags on where rollout generates.
type policyFlags struct {
	urls, protocol, router *string
}

func addPolicyFlags(fs *flag.FlagSet, o *loop.Options) policyFlags {
	fs.StringVar(&o.Tasks, "tasks", loop.TasksKV, "task family: kv (the built-in vocabulary) or text (a language model on --policy llamacpp://...; needs --no-train or --trainer external)")
	fs.StringVar(&o.Trainer, "trainer", loop.TrainerBuiltin, "who trains: builtin (the Go train stage) or external (a trainer outside the loop, python -m trajflow.train, consumes the batches topic and publishes every release; arguments in OUT/trainer.json)")
	fs.BoolVar(&o.NoTrain, "no-train", false, "leave the train stage out (the built-in trainer cannot train a server's model): release 0 only, each round closes once pack decided its groups")
	return policyFlags{
		urls:     fs.String("policy", "", "policy server replicas, comma-separated: sglang://HOST:PORT, vllm://HOST:PORT, llamacpp://HOST:PORT, or http://HOST:PORT with --policy-protocol (default: the built-in policy in process); weight sync runs in the loop, the servers read releases from OUT/releases"),
		protocol: fs.String("policy-protocol", "", "protocol of http:// --policy URLs: sglang, vllm or llamacpp"),
		router:   fs.String("llamacpp-router", "auto", "llama.cpp replicas are routers over policy-vNNNNNNNN models (true; weight sync loads each release) or single-model servers (false: release 0 only); auto: routers unless --no-train"),
	}
}

// apply fills o's policy section from the flags.
func (f policyFlags) apply(o *loop.Options) error {
	if *f.urls == "" {
		if *f.protocol != "" || *f.router != "auto" {
			return fmt.Errorf("%w: --policy-protocol and --llamacpp-router need --policy", errUsage)
		}
		return nil
	}
	urls, err := listFlag("--policy", *f.urls)
	if err != nil {
		return err
	}
	for _, raw := range urls {
		if u, err := url.Parse(raw); err == nil && u.Host != "" {
			if err := checkHostPort(u.Host, false); err != nil {
				return fmt.Errorf("%w: --policy %q: %w", errUsage, raw, err)
			}
		}
	}
	p, err := loop.ParsePolicy(*f.urls, *f.protocol)
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	switch *f.router {
	case "auto":
		p.Router = p.Protocol == contract.PolicyLlamaCpp && !o.NoTrain
	case "true", "false":
		if p.Protocol != contract.PolicyLlamaCpp {
			return fmt.Errorf("%w: --llamacpp-router is for llamacpp replicas, not %s", errUsage, p.Protocol)
		}
		p.Router = *f.router == "true"
	default:
		return fmt.Errorf("%w: --llamacpp-router %q: want auto, true or false", errUsage, *f.router)
	}
	o.Policy = p
	return nil
}
