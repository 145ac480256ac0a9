// kvflow-compose loads compose files the way `docker compose config` does, with compose-go (the
// library `docker compose` itself loads them with), so that the compose files are checked on
// machines without the docker compose plugin (tests/kvflow/test_compose.py).
//
//	kvflow-compose [-f FILE]... [--profile NAME]... config [--format json|yaml]
//
// Environment variables are interpolated from the process environment (and a .env file next to
// the first compose file, as docker compose reads it); an error, such as a required variable
// without a value, is printed to stderr with exit status 1.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/compose-spec/compose-go/v2/cli"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run(args []string) error {
	var files, profiles []string
	format, command := "yaml", ""
	for i := 0; i < len(args); i++ {
		value := func() (string, error) {
			if i+1 >= len(args) {
				return "", fmt.Errorf("%s needs a value", args[i])
			}
			i++
			return args[i], nil
		}
		var err error
		var v string
		switch args[i] {
		case "-f", "--file":
			v, err = value()
			files = append(files, v)
		case "--profile":
			v, err = value()
			profiles = append(profiles, v)
		case "--format":
			v, err = value()
			format = v
		case "config":
			command = "config"
		default:
			return fmt.Errorf("unknown argument %q (usage: kvflow-compose [-f FILE]... [--profile NAME]... config [--format json|yaml])", args[i])
		}
		if err != nil {
			return err
		}
	}
	if command != "config" {
		return fmt.Errorf("only the config command is supported")
	}
	if format != "json" && format != "yaml" {
		return fmt.Errorf("unknown format %q (json or yaml)", format)
	}
	wd, err := os.Getwd()
	if err != nil {
		return err
	}
	opts, err := cli.NewProjectOptions(files,
		cli.WithWorkingDirectory(wd),
		cli.WithOsEnv,
		cli.WithDotEnv,
		cli.WithConfigFileEnv,
		cli.WithDefaultConfigPath,
		cli.WithProfiles(profiles),
		cli.WithName("kvflow"),
	)
	if err != nil {
		return err
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		return err
	}
	var out []byte
	if format == "json" {
		out, err = project.MarshalJSON()
	} else {
		out, err = project.MarshalYAML()
	}
	if err != nil {
		return err
	}
	_, err = os.Stdout.Write(append(out, '\n'))
	return err
}
