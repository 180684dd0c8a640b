package deploy

import (
	"bytes"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/agentconfig"
)

// The multi-host example of docs/deploy.md is a valid agent configuration with the cluster it describes.
func TestDeployDocExampleConfig(t *testing.T) {
	doc, err := os.ReadFile("../docs/deploy.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?s)```toml\n(.*?)```").FindAllSubmatch(doc, -1)
	if len(blocks) != 1 {
		t.Fatalf("docs/deploy.md has %d toml blocks, want the one example", len(blocks))
	}
	cfg, err := agentconfig.ParseConfig(blocks[0][1])
	if err != nil {
		t.Fatalf("the example in docs/deploy.md is not a valid configuration: %v", err)
	}
	roles := map[agentconfig.Role]int{}
	for _, m := range cfg.Cluster.Members {
		roles[m.Role]++
	}
	self, ok := cfg.Member(cfg.Name)
	if roles[agentconfig.RoleNode] != 3 || roles[agentconfig.RoleSpare] != 1 || !ok || self.Address != cfg.Cluster.Listen {
		t.Errorf("example: %d nodes, %d spares, %s listens on %s (member address %s); want 3 + 1 and its own address",
			roles[agentconfig.RoleNode], roles[agentconfig.RoleSpare], cfg.Name, cfg.Cluster.Listen, self.Address)
	}
	if cfg.Cluster.Cert != "/etc/ftkit/pki/"+cfg.Name+".crt" || cfg.Cluster.Key != "/etc/ftkit/pki/"+cfg.Name+".key" ||
		cfg.Cluster.CA != "/etc/ftkit/pki/cluster_ca.crt" {
		t.Errorf("example credentials %s %s %s: want the files ftctl pki issue writes", cfg.Cluster.CA, cfg.Cluster.Cert, cfg.Cluster.Key)
	}
}

// The fence command examples of docs/deploy.md are shell scripts sh accepts, each exiting 0 only after it
// read the power state back (the contract in docs/operations.md).
func TestDeployDocFenceScripts(t *testing.T) {
	doc, err := os.ReadFile("../docs/deploy.md")
	if err != nil {
		t.Fatal(err)
	}
	scripts := regexp.MustCompile("(?s)```sh\n(#!/bin/sh\n# /usr/local/sbin/ftkit-fence-.*?)```").FindAllSubmatch(doc, -1)
	if len(scripts) != 2 {
		t.Fatalf("docs/deploy.md has %d fence command examples, want IPMI and Redfish", len(scripts))
	}
	for _, s := range scripts {
		cmd := exec.Command("sh", "-n")
		cmd.Stdin = bytes.NewReader(s[1])
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("sh -n: %v\n%s\n%s", err, out, s[1])
		}
		// The one exit 0 is inside the loop that reads the power state back.
		var exits0, loop []int
		for i, l := range strings.Split(string(s[1]), "\n") {
			switch {
			case strings.TrimSpace(l) == "exit 0":
				exits0 = append(exits0, i)
			case strings.HasPrefix(l, "for "):
				loop = append(loop, i)
			}
		}
		if len(exits0) != 1 || len(loop) != 1 || exits0[0] < loop[0] {
			t.Errorf("example exits 0 at lines %v, loop at %v: want once, in the status loop:\n%s", exits0, loop, s[1])
		}
	}
}
