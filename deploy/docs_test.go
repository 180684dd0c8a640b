package deploy

import (
	"os"
	"regexp"
	"testing"

	"github.com/ftkit/ftkit/agent"
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
	cfg, err := agent.ParseConfig(blocks[0][1])
	if err != nil {
		t.Fatalf("the example in docs/deploy.md is not a valid configuration: %v", err)
	}
	roles := map[agent.Role]int{}
	for _, m := range cfg.Cluster.Members {
		roles[m.Role]++
	}
	self, ok := cfg.Member(cfg.Name)
	if roles[agent.RoleNode] != 3 || roles[agent.RoleSpare] != 1 || !ok || self.Address != cfg.Cluster.Listen {
		t.Errorf("example: %d nodes, %d spares, %s listens on %s (member address %s); want 3 + 1 and its own address",
			roles[agent.RoleNode], roles[agent.RoleSpare], cfg.Name, cfg.Cluster.Listen, self.Address)
	}
	if cfg.Cluster.Cert != "/etc/ftkit/pki/"+cfg.Name+".crt" || cfg.Cluster.Key != "/etc/ftkit/pki/"+cfg.Name+".key" ||
		cfg.Cluster.CA != "/etc/ftkit/pki/cluster_ca.crt" {
		t.Errorf("example credentials %s %s %s: want the files ftctl pki issue writes", cfg.Cluster.CA, cfg.Cluster.Cert, cfg.Cluster.Key)
	}
}
